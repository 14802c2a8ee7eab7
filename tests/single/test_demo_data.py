"""The demo's data (examples/gpt.py: `markov_batch`, used by examples/train_gpt.py): walks on one fixed sparse
Markov chain, a pure function of (seed, step, rank), so that the demo's loss can fall and a resumed job
trains on the batches an uninterrupted one would."""

from __future__ import annotations

import math

import pytest
import torch

from examples.gpt import MARKOV_BRANCHING, GPTConfig, markov_batch, markov_floor, markov_successors

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)


def test_every_next_token_is_one_of_the_current_tokens_successors():
    succ = markov_successors(CFG.vocab_size)
    assert succ.shape == (CFG.vocab_size, MARKOV_BRANCHING)
    assert all(len(set(row.tolist())) == MARKOV_BRANCHING for row in succ)  # distinct: the floor is ln 4
    x, y = markov_batch(CFG, 8, 16, step=3, rank=1)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    allowed = (succ[x] == y.unsqueeze(-1)).any(dim=-1)
    assert bool(allowed.all())
    # the walks use all of a token's successors, not just one (there is something to learn, not to copy)
    assert len({(a, b) for a, b in zip(x.flatten().tolist(), y.flatten().tolist())}) > CFG.vocab_size


def test_batches_depend_on_seed_step_and_rank_only():
    same = markov_batch(CFG, 4, 16, step=5, rank=1, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(same, markov_batch(CFG, 4, 16, step=5, rank=1, seed=2)))
    for other in (dict(step=6, rank=1, seed=2), dict(step=5, rank=0, seed=2), dict(step=5, rank=1, seed=3)):
        assert not torch.equal(same[0], markov_batch(CFG, 4, 16, **other)[0]), other
    # ranks draw different walks from one chain; another seed is another chain
    assert torch.equal(markov_successors(64, seed=2), markov_successors(64, seed=2))
    assert not torch.equal(markov_successors(64, seed=2), markov_successors(64, seed=3))


def test_small_vocabularies_and_the_floor():
    tiny = GPTConfig(vocab_size=3, d_model=8, n_layers=1, n_heads=4, max_seq_len=4)
    succ = markov_successors(3)
    assert succ.shape == (3, 3) and all(sorted(row.tolist()) == [0, 1, 2] for row in succ)
    x, y = markov_batch(tiny, 2, 4, step=0)
    assert int(x.max()) < 3 and int(y.max()) < 3
    assert markov_floor(1024) == pytest.approx(math.log(4)) and markov_floor(3) == pytest.approx(math.log(3))
    with pytest.raises(ValueError, match="must be >= 1"):
        markov_successors(0)


def test_the_demo_trains_on_the_chain():
    import examples.train_gpt as demo

    cfg = demo.TrainConfig(vocab=64, seq_len=16, seed=7)
    x, y = demo.synthetic_batch(cfg.gpt(), 2, 16, step=4, rank=1, seed=cfg.seed)
    ref = markov_batch(cfg.gpt(), 2, 16, step=4, rank=1, seed=7)
    assert torch.equal(x, ref[0]) and torch.equal(y, ref[1])


TINY = dict(mode="eager", d_model=32, layers=1, vocab=64, seq_len=16, batch=2, checkpoint_every=2, log_level="WARNING")


def _final(directory, steps: int) -> dict:
    from examples import checkpoint

    return checkpoint.load(str(directory / f"step_{steps:08d}.pt"))


def test_a_resumed_demo_continues_the_same_data_stream(pg, tmp_path, capsys):
    import examples.train_gpt as demo

    straight, split = tmp_path / "straight", tmp_path / "split"
    demo.train(demo.TrainConfig(steps=6, checkpoint_dir=str(straight), **TINY), 0, 1, torch.device("cpu"))
    demo.train(demo.TrainConfig(steps=3, checkpoint_dir=str(split), **TINY), 0, 1, torch.device("cpu"))
    demo.train(demo.TrainConfig(steps=6, checkpoint_dir=str(split), **TINY), 0, 1, torch.device("cpu"))
    assert "checkpoint: resuming from step 3" in capsys.readouterr().out
    ref, got = _final(straight, 6), _final(split, 6)
    assert got["data"] == ref["data"] == demo.TrainConfig(**TINY).data()
    for name, value in ref["model"].items():
        assert torch.equal(got["model"][name], value), name

    # another data stream is refused by name, before a step is trained
    with pytest.raises(ValueError, match=r"was trained on markov_batch\(.*seed=0\).*seed=1\)"):
        demo.train(demo.TrainConfig(steps=8, seed=1, checkpoint_dir=str(split), **TINY), 0, 1, torch.device("cpu"))
