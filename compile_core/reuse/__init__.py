"""Compile each distinct piece once per job, and reuse it everywhere else.

* `compile_once.py` -- `CompileOnce`: structurally identical pieces share one compile; which rank compiles;
* `piece_records.py` -- what became of each piece (compiled here, reused, from rank N, from the cache);
* `idle_work.py` -- what a rank about to wait for another's compile may compile meanwhile;
* `claims.py` -- file-lock claims: one process of a node compiles a piece, the others wait for its cache entry;
* `store_claims.py` -- the same across nodes through the c10d store, shipping the compiled artifacts
  (packed by `inductor/artifacts.py`), never a shared filesystem.
"""
