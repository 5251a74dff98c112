"""aiospec._speedups, the C join of streaming chat logprobs: built where it can be, and every
argument checked. That it writes the Python join's bytes is tested in test_openai.py."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
from _nativehelpers import assert_built

from aiospec.openai import ChatLogprobsFormatter, SimpleTokenizer, _logprobs, _tokencache


def _mod() -> ModuleType:
    if _logprobs._speedups is None:
        pytest.skip("aiospec._speedups is not built here; test_speedups_is_built says why")
    return _logprobs._speedups


def test_speedups_is_built() -> None:
    """Where the install could compile it, the module must be there and current."""
    assert_built("aiospec._speedups", "AIOSPEC_PURE_PYTHON", _logprobs._SPEEDUPS_ABI, _logprobs._speedups)


def _args(**over: Any) -> list[Any]:
    """Valid arguments for 2 positions with n = 1, with some replaced."""
    c = _tokencache.cache_for(SimpleTokenizer({0: "a", 1: "b", 2: "c"}))
    a: dict[str, Any] = {
        "ids": np.array([0, 1], np.int32),
        "top_ids": np.array([[1, 2], [2, 0]], np.int32),
        "n": 1,
        "floats": b"[-0.5,-1.5,-2.0,-3.0]",
        "null_as": b"-9999.0",
        "head": c.head,
        "main": c.main,
        "top": c.top,
        "top_last": c.top_last,
        "main_bare": c.main_bare,
    }
    a.update(over)
    return list(a.values())


def test_valid_arguments_give_json() -> None:
    import json

    out = _mod().chat_logprobs(*_args())
    doc = json.loads(out)
    assert [e["token"] for e in doc["content"]] == ["a", "b"]
    assert [e["logprob"] for e in doc["content"]] == [-0.5, -1.5]
    assert [e["top_logprobs"][0]["logprob"] for e in doc["content"]] == [-2.0, -3.0]
    nulls = _mod().chat_logprobs(*_args(floats=b"[null,-1.5,-2.0,null]"))
    assert [e["logprob"] for e in json.loads(nulls)["content"]] == [-9999.0, -1.5]


@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        ({"ids": [0, 1]}, TypeError, r"^ids is list: expected an int32 array$"),
        (
            {"ids": np.array([0, 1], np.int64)},
            ValueError,
            r"^ids has format l, 1 dimension\(s\): expected int32 with 1$",
        ),
        ({"ids": np.zeros((2, 1), np.int32)}, ValueError, r"^ids has format i, 2 dimension\(s\)"),
        ({"ids": np.array([], np.int32)}, ValueError, r"^ids has 0 elements: expected at least 1$"),
        ({"n": -1}, ValueError, r"^n = -1: expected 0\.\.1024$"),
        ({"top_ids": None}, TypeError, r"^top_ids is NoneType: expected an int32 array$"),
        ({"top_ids": np.zeros((3, 2), np.int32)}, ValueError, r"^top_ids has shape \(3, 2\): expected \(2, >= 1\)$"),
        ({"n": 3}, ValueError, r"^top_ids has shape \(2, 2\): expected \(2, >= 3\)$"),
        ({"floats": "[-1]"}, TypeError, r"^floats is str: expected bytes \(a JSON array\)$"),
        ({"floats": b"-0.5,-1.5"}, ValueError, r"^floats is not a JSON array$"),
        (
            {"floats": b"[-0.5,-1.5,-2.0]"},
            ValueError,
            r"^floats does not hold 4 values \(m = 2 positions x \(1 \+ n = 1\)\)$",
        ),
        ({"floats": b"[-0.5,-1.5,-2.0,-3.0,-4.0]"}, ValueError, r"^floats does not hold 4 values"),
        ({"floats": b"[-0.5,,-2.0,-3.0]"}, ValueError, r"^floats does not hold 4 values"),
        ({"null_as": b""}, TypeError, r"^null_as is bytes: expected non-empty bytes"),
        ({"head": [b"x"]}, TypeError, r"^head is list: expected a dict of token id -> bytes$"),
        ({"top_last": {}}, KeyError, r"^1$"),  # a plain dict has no __missing__
        ({"main": {0: "s", 1: "t"}}, TypeError, r"^main\[0\] is str: expected bytes$"),
        (
            {"n": 0, "floats": b"[-0.5,-1.5]", "main_bare": {0: b"x,", 1: b"no-comma"}},
            ValueError,
            r"^the last piece of the content list does not end with a comma$",
        ),
    ],
)
def test_every_argument_is_checked(over: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        _mod().chat_logprobs(*_args(**over))


def test_sizes_that_overflow_are_refused() -> None:
    from numpy.lib.stride_tricks import as_strided

    huge = 1 << 48  # zero strides: no memory behind the shapes
    ids = as_strided(np.zeros(1, np.int32), shape=(huge,), strides=(0,))
    tids = as_strided(np.zeros(1, np.int32), shape=(huge, 1024), strides=(0, 0))
    with pytest.raises(ValueError, match=rf"^ids has {huge} elements: too many for n = 1024$"):
        _mod().chat_logprobs(*_args(ids=ids, top_ids=tids, n=1024))


def test_wrong_argument_count() -> None:
    with pytest.raises(TypeError, match=r"^chat_logprobs\(\) takes 10 arguments \(2 given\)$"):
        _mod().chat_logprobs(1, 2)


def test_without_top_logprobs_the_top_maps_are_not_needed() -> None:
    import json

    c = _tokencache.cache_for(SimpleTokenizer({0: "a", 1: "b"}))
    out = _mod().chat_logprobs(np.array([1, 0], np.int32), None, 0, b"[-1.0,-2.0]", b"-9999.0", c.head, None,
                               None, None, c.main_bare)  # fmt: skip
    assert json.loads(out) == {"content": [
        {"token": "b", "logprob": -1.0, "bytes": [98], "top_logprobs": []},
        {"token": "a", "logprob": -2.0, "bytes": [97], "top_logprobs": []},
    ]}  # fmt: skip
    # a formatter falls back to nothing else: the same bytes as the Python join
    fmt = ChatLogprobsFormatter(SimpleTokenizer({0: "a", 1: "b"}), top_logprobs=0)
    from aiospec._stream import Delta

    d = Delta(token_ids=np.array([1, 0], np.int32), logprobs=np.array([-1, -2], np.float32), ranks=np.ones(2, np.int32))
    assert fmt.format_json(d) == out


def test_ids_of_other_integer_types_take_the_python_join() -> None:
    import msgspec

    from aiospec._stream import Delta

    fmt = ChatLogprobsFormatter(SimpleTokenizer({0: "a", 1: "b", 2: "c"}), top_logprobs=2)
    for dtype in (np.int64, np.uint16, np.int32):
        d = Delta(
            token_ids=np.array([2, 0], dtype),
            logprobs=np.array([-1, -2], np.float32),
            ranks=np.ones(2, np.int32),
            topk_ids=np.array([[0, 1], [1, 2]], dtype),
            topk_logprobs=np.array([[-0.5, -3], [-0.25, -4]], np.float32),
        )
        assert fmt.format_json(d) == msgspec.json.encode(fmt.format(d))


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({"AIOSPEC_PURE_PYTHON": "1"}, "aiospec._speedups: the Python path (AIOSPEC_PURE_PYTHON is set)"),
        ({"SHM_PURE_PYTHON": "1"}, "shm._native: the Python path (SHM_PURE_PYTHON is set)"),
    ],
)
def test_c_paths_say_which_module_is_left_out(env: dict[str, str], missing: str) -> None:
    """What the server warns about at start and the benchmarks record: a module asked off at
    run time reads as not in use, with the variable that asked."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json; from aiospec._cpaths import c_paths, missing_c_paths; "
        "print(json.dumps([c_paths(), missing_c_paths()]))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("AIOSPEC_PURE_PYTHON", "SHM_PURE_PYTHON")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=60, check=True
    )
    paths, why = json.loads(out.stdout)
    mod = missing.split(":")[0]
    assert paths[mod] is False
    assert missing in why
    # the other module is reported only when it is not in use either
    other = next(m for m in paths if m != mod)
    assert (other in " ".join(why)) == (not paths[other])
