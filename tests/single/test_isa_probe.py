"""Inductor's CPU vector-ISA load probe, remembered across processes (`remember_isa_probes`)."""

from __future__ import annotations

import pytest
from torch._inductor import cpu_vec_isa

from inductor import torch_inductor


@pytest.fixture
def counted_probe(monkeypatch):
    """Stand in for Inductor's probe: records each library it is asked to load, answers `answer[0]`."""
    if not hasattr(cpu_vec_isa.VecISA, "_probe_load"):
        pytest.skip("this torch's Inductor has no VecISA._probe_load (torch 2.11): no load step to remember")
    calls: list[str] = []
    answer = [True]

    def probe(self, output_path):
        calls.append(output_path)
        return answer[0]

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", probe)
    torch_inductor.remember_isa_probes()
    return calls, answer


def library(tmp_path):
    lib = tmp_path / "cabc.so"
    lib.write_bytes(b"\x7fELF")
    return str(lib)


def test_a_successful_load_is_not_probed_again(tmp_path, counted_probe):
    calls, _ = counted_probe
    lib = library(tmp_path)
    isa = cpu_vec_isa.VecAVX2()
    assert isa._probe_load(lib) and calls == [lib]
    assert isa._probe_load(lib) and calls == [lib]  # no second child
    assert [p.name for p in tmp_path.iterdir() if torch_inductor.ISA_PROBE_MARK in p.name]


def test_a_failed_load_is_probed_again(tmp_path, counted_probe):
    calls, answer = counted_probe
    lib = library(tmp_path)
    answer[0] = False
    isa = cpu_vec_isa.VecAVX2()
    assert not isa._probe_load(lib)
    assert not isa._probe_load(lib)
    assert calls == [lib, lib]
    assert not [p for p in tmp_path.iterdir() if torch_inductor.ISA_PROBE_MARK in p.name]


def test_another_library_path_or_environment_is_probed_again(tmp_path, counted_probe, monkeypatch):
    calls, _ = counted_probe
    lib = library(tmp_path)
    isa = cpu_vec_isa.VecAVX2()
    isa._probe_load(lib)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "elsewhere"))
    isa._probe_load(lib)
    other = tmp_path / "cdef.so"
    other.write_bytes(b"\x7fELF")
    isa._probe_load(str(other))
    assert calls == [lib, lib, str(other)]


def test_installing_twice_wraps_once(counted_probe):
    wrapped = cpu_vec_isa.VecISA._probe_load
    torch_inductor.remember_isa_probes()
    assert cpu_vec_isa.VecISA._probe_load is wrapped


def test_a_torch_without_the_load_step_is_left_to_probe_as_it_always_did(monkeypatch):
    """torch 2.11 has no `VecISA._probe_load`: asking for it there failed every Inductor compile."""
    monkeypatch.delattr(cpu_vec_isa.VecISA, "_probe_load", raising=False)  # torch 2.11 has none to take away
    torch_inductor.remember_isa_probes()
    assert not hasattr(cpu_vec_isa.VecISA, "_probe_load")
