#!/usr/bin/env bash
# Run nanoGPT's own train.py (github.com/karpathy/nanoGPT) on 2 gloo CPU ranks, once as the user has it
# (eager DDP) and once with the one-line change that hands the DDP model to compile_core, then compare.
#
#   examples/nanogpt_check.sh /path/to/nanoGPT                    # MODE=both: eager, ours, compare
#   MODE=eager examples/nanogpt_check.sh /path/to/nanoGPT         # only one of the two runs
#   MODE=ours BACKEND=inductor examples/nanogpt_check.sh /path/to/nanoGPT
#
# Environment: MODE (both|eager|ours, default both), BACKEND (compile_core backend for ours, default
# aot_eager), ITERS (default 20), TOL (largest loss difference accepted, default 1e-3), RUN_TIMEOUT
# (seconds per run, default 1200: a hang fails instead of waiting), REPORT (1, the default: ours prints
# rank 0's compile report after training; a diagnostic, not part of the user's change; 0 leaves it out),
# COMPILE_ARGS (more keyword arguments for ours' compile call, e.g. "bucket_cap_mb=0.1"; default none),
# TORCH_COMPILE (train.py's own --compile in both runs, default False; True: the script torch.compiles its
# model before DDP wraps it, as nanoGPT does by default, and ours' compile takes its place),
# PYTHON (default: this repo's .venv),
# WORK (where the copies, logs and checkpoints go; default a new temp dir, kept and printed).
#
# The checkout is copied, never edited. Two kinds of edit are made to the copy's train.py:
#   * CPU only, both modes (not part of the user's change): train.py sets device = cuda:<local rank> and
#     calls torch.cuda.set_device under DDP, and passes device_ids=[local rank] to DDP; on a CPU-only
#     machine the device given by --device is kept and DDP gets no device_ids.
#   * ours only (the user's change): right after `model = DDP(...)`,
#         model = compile_core.compile(model, backend=...)
#     plus `import compile_core` next to train.py's imports; train.py's own torch.compile is off in both
#     modes (--compile=False) unless TORCH_COMPILE=True turns it on in both.
# The dataset is made here: walks on a fixed random Markov chain over 64 tokens (each token is followed
# by one of 4 successors), so the loss starts near ln 64 = 4.16 and can fall towards ln 4 = 1.39.
set -euo pipefail

SRC=${1:?usage: $0 NANOGPT_DIR}
SRC=$(cd "$SRC" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)        # the repository root: on PYTHONPATH for `import compile_core`
MODE=${MODE:-both}
BACKEND=${BACKEND:-aot_eager}
ITERS=${ITERS:-20}
TOL=${TOL:-1e-3}
RUN_TIMEOUT=${RUN_TIMEOUT:-1200}
REPORT=${REPORT:-1}
COMPILE_ARGS=${COMPILE_ARGS:-}
TORCH_COMPILE=${TORCH_COMPILE:-False}
PYTHON=${PYTHON:-$HERE/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
WORK=${WORK:-$(mktemp -d /tmp/nanogpt_check.XXXXXX)}
mkdir -p "$WORK"
[ -f "$SRC/train.py" ] && [ -f "$SRC/model.py" ] || { echo "not a nanoGPT checkout: $SRC" >&2; exit 2; }
case "$MODE" in both) MODES="eager ours";; eager|ours) MODES=$MODE;; *) echo "MODE must be both|eager|ours" >&2; exit 2;; esac

prepare() {  # $1: mode; makes $WORK/$1 (a patched copy of the checkout with the dataset)
    local mode=$1 dir=$WORK/$1
    rm -rf "$dir" && cp -r "$SRC" "$dir"
    "$PYTHON" - "$dir/train.py" "$mode" "$BACKEND" "$REPORT" "$COMPILE_ARGS" <<'EOF'
import sys
path, mode, backend, report, extra = sys.argv[1:6]
src = open(path).read()

def swap(old, new):
    global src
    if src.count(old) != 1:
        sys.exit(f"nanogpt_check: expected exactly one {old!r} in train.py (nanoGPT changed?)")
    src = src.replace(old, new)

# CPU-only edit (both modes): keep --device=cpu under DDP, and no device_ids for a CPU module.
swap("    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n",
     "    if device.startswith('cuda'):  # nanogpt_check: CPU-only edit\n"
     "        device = f'cuda:{ddp_local_rank}'\n"
     "        torch.cuda.set_device(device)\n")
swap("    model = DDP(model, device_ids=[ddp_local_rank])\n",
     "    model = DDP(model, device_ids=[ddp_local_rank] if device.startswith('cuda') else None)"
     "  # nanogpt_check: CPU-only edit\n")
if mode == "ours":
    # The user's change: compile the DDP model with compile_core (in place; same object back).
    swap("from model import GPTConfig, GPT\n", "from model import GPTConfig, GPT\nimport compile_core\n")
    swap("  # nanogpt_check: CPU-only edit\n\n# helps estimate",
         "  # nanogpt_check: CPU-only edit\n"
         f"    model = compile_core.compile(model, backend={backend!r}{', ' + extra if extra else ''})  # nanogpt_check: the user's change\n"
         "\n# helps estimate")
    if report == "1":  # diagnostic only: what was compiled, and whether rank 0's evaluation recompiled
        swap("\nif ddp:\n    destroy_process_group()\n",
             "\nif ddp and master_process:  # nanogpt_check: diagnostic\n    print(model.report())\n"
             "\nif ddp:\n    destroy_process_group()\n")
open(path, "w").write(src)
EOF
    "$PYTHON" - "$dir/data/chk" <<'EOF'
import os, pickle, sys
import numpy as np
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
vocab, fanout = 64, 4
rng = np.random.default_rng(0)
succ = np.stack([rng.choice(vocab, fanout, replace=False) for _ in range(vocab)])  # successors of each token
def walk(n, seed):
    r = np.random.default_rng(seed)
    toks = np.empty(n, dtype=np.uint16)
    toks[0] = r.integers(vocab)
    picks = r.integers(fanout, size=n)
    for i in range(1, n):
        toks[i] = succ[toks[i - 1], picks[i]]
    return toks
walk(200_000, 1).tofile(os.path.join(out, "train.bin"))
walk(20_000, 2).tofile(os.path.join(out, "val.bin"))
with open(os.path.join(out, "meta.pkl"), "wb") as f:
    pickle.dump({"vocab_size": vocab}, f)
EOF
}

run() {  # $1: mode; trains in $WORK/$1, log in $WORK/$1.log, wall seconds in $WORK/$1.wall
    local mode=$1 dir=$WORK/$1 t0 t1 rc=0
    echo "=== $mode$([ "$mode" = ours ] && echo " (compile_core.compile, backend=$BACKEND${COMPILE_ARGS:+, $COMPILE_ARGS})"): $dir"
    grep -n "nanogpt_check" "$dir/train.py" | sed 's/^/    train.py:/'
    t0=$(date +%s.%N)
    (cd "$dir" && OMP_NUM_THREADS=1 PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" \
        timeout "$RUN_TIMEOUT" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 train.py \
        --dataset=chk --device=cpu --backend=gloo --compile="$TORCH_COMPILE" --dtype=float32 \
        --n_layer=2 --n_head=2 --n_embd=64 --block_size=32 --batch_size=4 --gradient_accumulation_steps=4 \
        --max_iters="$ITERS" --lr_decay_iters="$ITERS" --warmup_iters=2 --eval_interval=10 --eval_iters=2 \
        --log_interval=1 --always_save_checkpoint=True --out_dir=out) >"$WORK/$mode.log" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f\n", b - a }' > "$WORK/$mode.wall"
    echo "    exit $rc, wall $(cat "$WORK/$mode.wall") s (log: $WORK/$mode.log)"
    grep -E "^(step|iter) [0-9]+:" "$WORK/$mode.log" | sed 's/^/    /' || true
    sed -n '/^compile report:/,$p' "$WORK/$mode.log" | sed 's/^/    /'
    if [ "$rc" != 0 ]; then echo "--- $mode failed; end of its log:"; tail -n 60 "$WORK/$mode.log"; return "$rc"; fi
}

for m in $MODES; do prepare "$m"; done
status=0
for m in $MODES; do run "$m" || status=$?; done
[ "$MODE" = both ] && [ "$status" = 0 ] || exit "$status"

"$PYTHON" - "$WORK" "$TOL" "$TORCH_COMPILE" <<'EOF'
import re, sys
import torch
work, tol = sys.argv[1], float(sys.argv[2])
wrapped = sys.argv[3] == "True"  # train.py checkpoints torch.compile's wrapper: `_orig_mod.` keys, in both runs
pat = re.compile(r"^(step|iter) (\d+): (?:train loss ([\d.]+), val loss ([\d.]+)|loss ([\d.]+))", re.M)

def losses(mode):
    found = {}
    for kind, it, tr, va, lo in pat.findall(open(f"{work}/{mode}.log").read()):
        found[(kind, int(it))] = (float(tr), float(va)) if kind == "step" else (float(lo),)
    return found

e, o = losses("eager"), losses("ours")
ok = True
if e.keys() != o.keys() or not e:
    print(f"loss lines differ: eager has {sorted(e)}, ours has {sorted(o)}"); ok = False
worst = 0.0
print(f"{'line':>9} {'eager':>17} {'ours':>17}  max |diff|")
for key in sorted(e.keys() & o.keys(), key=lambda k: (k[1], k[0] == "iter")):
    d = max(abs(a - b) for a, b in zip(e[key], o[key]))
    worst = max(worst, d)
    fmt = lambda v: "/".join(f"{x:.4f}" for x in v)
    print(f"{key[0]:>4} {key[1]:>4} {fmt(e[key]):>17} {fmt(o[key]):>17}  {d:.4f}")
print(f"largest loss difference {worst:.4f} (printed to 4 decimals; accepted up to {tol})")
ok &= worst <= tol

ce = torch.load(f"{work}/eager/out/ckpt.pt", map_location="cpu", weights_only=False)
co = torch.load(f"{work}/ours/out/ckpt.pt", map_location="cpu", weights_only=False)
ke, ko = list(ce["model"]), list(co["model"])
prefixed = [k for k in ko if k.startswith(("module.",) if wrapped else ("module.", "_orig_mod."))]
print(f"checkpoint: iter {ce['iter_num']} / {co['iter_num']}, {len(ke)} / {len(ko)} model keys (eager / ours); "
      f"same keys in the same order: {ke == ko}; keys with a prefix eager's lack in ours: {len(prefixed)}")
ok &= ke == ko and not prefixed and ce["iter_num"] == co["iter_num"]
if ke == ko:
    diff = max((ce["model"][k].float() - co["model"][k].float()).abs().max().item() for k in ke)
    print(f"checkpoint weights: largest |eager - ours| {diff:.3e}")
    ok &= len(ce["optimizer"]["state"]) == len(co["optimizer"]["state"])
print("nanogpt_check:", "OK" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
EOF
