"""The FastDeploy-style token path and the kernel's SysV limits: nothing raises them unless
asked, and whatever raises them puts them back. The tests point the module at files of their
own: a test never changes the machine's kernel settings."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from aiospec.baselines import _msg_limits as fd
from aiospec.server._cli import _max_batch, _settings, register


@pytest.fixture
def limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    msgmax, msgmnb = tmp_path / "msgmax", tmp_path / "msgmnb"
    msgmax.write_text("8192\n")  # a new machine's defaults
    msgmnb.write_text("16384\n")
    monkeypatch.setattr(fd, "_MSGMAX", str(msgmax))
    monkeypatch.setattr(fd, "_MSGMNB", str(msgmnb))
    return msgmax, msgmnb


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    return p.parse_args(["serve", *argv])


def test_raise_then_restore(limits: tuple[Path, Path]) -> None:
    msgmax, msgmnb = limits
    report = fd.raise_msg_limits()
    assert report == {"msgmax": {"before": 8192, "value": 1 << 20}, "msgmnb": {"before": 16384, "value": 256 << 20}}
    assert fd.read_msg_limits() == {"msgmax": 1 << 20, "msgmnb": 256 << 20}
    fd.restore_msg_limits(report)
    assert (msgmax.read_text(), msgmnb.read_text()) == ("8192", "16384")


def test_restore_leaves_a_value_somebody_else_changed(limits: tuple[Path, Path]) -> None:
    msgmax, msgmnb = limits
    report = fd.raise_msg_limits()
    msgmax.write_text("2000000")  # an operator's own change meanwhile
    fd.restore_msg_limits(report)
    assert (msgmax.read_text(), msgmnb.read_text()) == ("2000000", "16384")


def test_nothing_to_raise_nothing_to_restore(limits: tuple[Path, Path]) -> None:
    msgmax, _ = limits
    msgmax.write_text(str(4 << 20))
    report = fd.raise_msg_limits()
    assert report["msgmax"] == {"before": 4 << 20, "value": 4 << 20}
    fd.restore_msg_limits(report)
    assert msgmax.read_text() == str(4 << 20)


def test_the_fastdeploy_path_leaves_the_limits_alone_unless_asked(limits: tuple[Path, Path]) -> None:
    from aiospec.server._baselines import open_api_side

    settings = _settings(_parse("--token-path", "fastdeploy"))
    assert settings.engine.max_batch == 512 and settings.raise_msg_limits is False
    with pytest.raises(RuntimeError) as info:
        asyncio.run(open_api_side(settings.engine))
    assert str(info.value) == (
        "kernel.msgmax = 8192: the FastDeploy-style path sends 530448-byte messages (--raise-msg-limits raises "
        "it (as root); the value is put back at exit)"
    )
    assert [p.read_text() for p in limits] == ["8192\n", "16384\n"]


def test_raised_limits_are_put_back_at_close(limits: tuple[Path, Path]) -> None:
    pytest.importorskip("sysv_ipc", reason="the FastDeploy-style path needs the 'bench' extra")
    from aiospec.server._baselines import open_api_side

    async def main() -> None:
        side = await open_api_side(_settings(_parse("--token-path", "fastdeploy")).engine, raise_msg_limits=True)
        assert fd.read_msg_limits() == {"msgmax": 1 << 20, "msgmnb": 256 << 20}
        await side.aclose()

    asyncio.run(main())
    assert [p.read_text() for p in limits] == ["8192", "16384"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [((), 1024), (("--token-path", "vllm"), 1024), (("--token-path", "fastdeploy"), 512), (("--max-batch", "7"), 7)],
)
def test_max_batch_default_fits_the_token_path(argv: tuple[str, ...], expected: int) -> None:
    assert _max_batch(_parse(*argv)) == expected


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_machine_with_default_limits_gets_one_line_before_anything_starts(
    limits: tuple[Path, Path], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiospec.cli import main

    assert main([command, "--token-path", "fastdeploy"]) == 2
    assert capsys.readouterr().err == (
        f"aiospec {command}: --token-path fastdeploy: kernel.msgmax = 8192, but the FastDeploy-style path sends "
        "530448-byte messages; --raise-msg-limits raises it for the run (as root)\n"
    )
