"""compile_core/recompile_reasons.py: Dynamo's guard failures on our entry frame, told in the user's terms (pure)."""

from __future__ import annotations

from compile_core.recompile_reasons import EntryNames

NAMES = EntryNames(
    entry_where="/lib/compile_core/api.py:371 compiled_entry",
    user_where="/home/u/model.py:9 Net.forward",
    positional=("x", "mask"),
    library_dirs=("/lib/compile_core", "/lib/aot", "/venv/torch"),
)

# As torch 2.11, 2.13 and 2.14 word it (one failed cache entry; session 65).
PAD = " " * 37  # Dynamo pads each expression to one column before its source comment
VALUE_GUARD = (
    "1/1: kwargs['scale'] == 2"
    + PAD
    + "# return self.b(h) * scale  # home/u/model.py:12 in forward\n"
    + """User stack trace:
  File "/lib/compile_core/api.py", line 373, in compiled_entry
    return call_uncompiled(inner, *args, **kwargs)
  File "/lib/aot/torch_eager.py", line 46, in call_uncompiled
    return module._call_impl(*args, **kwargs)
  File "/venv/torch/nn/modules/module.py", line 1789, in _call_impl
    return forward_call(*args, **kwargs)
  File "/home/u/model.py", line 12, in forward
    return self.b(h) * scale"""
)

KWARGS_GUARD = (
    "1/0: not kwargs" + PAD + "# return call_uncompiled(inner, *args, **kwargs)  # lib/compile_core/api.py:373 in "
    "compiled_entry\nUser stack trace:\n"
    '  File "/lib/compile_core/api.py", line 373, in compiled_entry\n'
    "    return call_uncompiled(inner, *args, **kwargs)"
)


def test_a_guard_on_a_keyword_value_names_the_parameter_and_the_users_line():
    assert NAMES.translate(VALUE_GUARD, NAMES.entry_where) == (
        "1/1: scale == 2 (used at /home/u/model.py:12 in forward)",
        "/home/u/model.py:9 Net.forward",
    )


def test_guards_on_how_the_call_passed_its_arguments_read_as_such():
    assert NAMES.translate(KWARGS_GUARD, NAMES.entry_where)[0] == "1/0: no keyword arguments"
    cases = {
        "1/2: len(args) == 1": "1/2: number of positional arguments == 1",
        "1/3: len(kwargs) == 2": "1/3: number of keyword arguments == 2",
        "1/4: KeyError on kwargs['scale']": "1/4: keyword argument 'scale' not passed",
        "1/5: tensor 'args[0]' size mismatch at index 0. expected 5, actual 7": (
            "1/5: tensor 'x' size mismatch at index 0. expected 5, actual 7"
        ),
        "1/6: args[1] is None": "1/6: mask is None",
        "1/7: args[2] == 3": "1/7: positional argument 2 == 3",  # past the names the signature has
        "1/8: L['args'][0].dtype == torch.float32 and L['kwargs']['scale'] == 1": (
            "1/8: x.dtype == torch.float32 and scale == 1"
        ),
    }
    for given, told in cases.items():
        assert NAMES.translate(given, NAMES.entry_where)[0] == told, given


def test_another_frames_guard_failure_is_left_as_dynamo_gave_it():
    # a frame resumed after a graph break in the user's code guards the user's own names already
    where = "/home/u/model.py:20 torch_dynamo_resume_in_forward_at_14"
    assert NAMES.translate(VALUE_GUARD, where) == (VALUE_GUARD, where)
