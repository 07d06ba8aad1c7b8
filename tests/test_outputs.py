"""Outputs that cannot be written end in one clean error and leave nothing behind: an unwritable or missing
folder, a full disk (a size limit on files, and a real 64 KiB tmpfs where this machine can mount one), a
real Ctrl-C in the middle of a write; a chat history killed mid-save keeps its last good file."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edgellm.atomic import AtomicFile, AtomicFolder, write_text_atomic
from edgellm.errors import OutputError
from tests.test_errors_cli import assert_clean_error, run_cli

ROOT = Path(__file__).resolve().parents[1]


def quantize(src, out, *extra, **run):
    return run_cli("quantize", str(src), "-o", str(out), "--fast", *extra, **run)


@pytest.mark.parametrize("out", ["/proc/nope.gguf", "/proc/nope"])
def test_unwritable_folder(tiny_llama, out):
    """/proc takes no new files, for root too (a chmod'ed folder would not stop root)."""
    assert_clean_error(quantize(tiny_llama[0], out), out, "cannot write")


@pytest.mark.parametrize("name", ["x.gguf", "x"])
def test_missing_folder(tiny_llama, tmp_path, name):
    out = tmp_path / "missing" / name
    assert_clean_error(quantize(tiny_llama[0], out), str(out), "does not exist")
    assert list(tmp_path.iterdir()) == []


def _limited(fsize: int):
    def apply():  # in the child: files may not grow past `fsize`; a write past it fails with EFBIG
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return apply


@pytest.mark.parametrize("fmt,name", [("gguf", "out.gguf"), ("edgellm", "out")])
def test_disk_full_mid_write(tiny_llama, tmp_path, fmt, name):
    """RLIMIT_FSIZE makes every write past 16 KiB fail as a full disk does (the output is ~200 KiB)."""
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    proc = subprocess.run([sys.executable, "-m", "edgellm.cli", "quantize", str(tiny_llama[0]), "-o",
                           str(out_dir / name), "--fast", "--format", fmt], capture_output=True, text=True,
                          timeout=300, preexec_fn=_limited(16 << 10))
    assert_clean_error(proc, str(out_dir / name), "write failed")
    assert list(out_dir.iterdir()) == []  # no partial output, no temp file


def _mount_cmd() -> list[str] | None:
    """A command prefix that gives a private mount namespace where we may mount a tmpfs, or None."""
    if not shutil.which("unshare"):
        return None
    prefix = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    try:
        ok = subprocess.run(prefix + ["sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                            capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if ok else None


def test_real_full_tmpfs(tiny_llama, tmp_path):
    """A real ENOSPC from a 64 KiB tmpfs (mounted in a private namespace; the test is skipped where the
    machine allows no mount: test_disk_full_mid_write covers the same path everywhere)."""
    prefix = _mount_cmd()
    if prefix is None:
        pytest.skip("no mount namespace here (unshare refused)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=64k tmpfs {mnt} && "
              f"{sys.executable} -m edgellm.cli quantize {tiny_llama[0]} -o {mnt}/out.gguf --fast; "
              f"echo rc=$? >&2; ls -A {mnt} >&2")
    proc = subprocess.run(prefix + ["sh", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "rc=2", proc.stderr  # `ls -A` printed nothing: the tmpfs is empty
    assert lines[0].startswith(f"edgellm: error: {mnt}/out.gguf: write failed ("), proc.stderr
    assert "disk is full" in lines[0] or "No space left" in lines[0], proc.stderr
    assert len(lines) == 2 and "Traceback" not in proc.stderr


INTERRUPT = """
import os, signal, sys
# Ctrl-C raises KeyboardInterrupt even where the test runner was started with SIGINT ignored (a background job)
signal.signal(signal.SIGINT, signal.default_int_handler)
{patch}
from edgellm.cli import main
sys.exit(main(sys.argv[1:]))
"""
PATCH_GGUF = """
import gguf
real = gguf.GGUFWriter.write_tensors_to_file
def write(self, *a, **k):
    self.fout[0].write(b"partial")  # some bytes are on disk, then the user presses Ctrl-C
    self.fout[0].flush()
    os.kill(os.getpid(), signal.SIGINT)
    return real(self, *a, **k)
gguf.GGUFWriter.write_tensors_to_file = write
"""
PATCH_SAFETENSORS = """
import safetensors.torch
real = safetensors.torch.save_file
def save(tensors, path, *a, **k):
    real(tensors, path, *a, **k)
    os.kill(os.getpid(), signal.SIGINT)
safetensors.torch.save_file = save
"""


@pytest.mark.parametrize("patch,name", [(PATCH_GGUF, "out.gguf"), (PATCH_SAFETENSORS, "out")])
def test_ctrl_c_mid_write_leaves_nothing(tiny_llama, tmp_path, patch, name):
    """A real SIGINT delivered while the output is half written: exit 130, a short note, nothing on disk."""
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    code = INTERRUPT.format(patch=textwrap.dedent(patch))
    proc = subprocess.run([sys.executable, "-c", code, "quantize", str(tiny_llama[0]), "-o", str(out_dir / name),
                           "--fast"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "interrupted" in proc.stderr
    assert list(out_dir.iterdir()) == []


def test_replacing_a_folder_keeps_the_old_one_on_failure(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "weights").write_text("old")
    with pytest.raises(OutputError, match="No space left"):
        with AtomicFolder(out) as tmp:
            (tmp / "weights").write_text("new, half")
            raise OSError(28, "No space left on device")
    assert (out / "weights").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["model"]
    with AtomicFolder(out) as tmp:
        (tmp / "weights").write_text("new")
    assert (out / "weights").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_outputs_get_the_users_file_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.json", "{}")
        with AtomicFolder(tmp_path / "f") as tmp:
            (tmp / "w").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "f" / "w").stat().st_mode & 0o777 == 0o644


def test_a_folder_where_a_file_goes(tmp_path):
    with pytest.raises(OutputError, match="is a folder"):
        with AtomicFile(tmp_path):
            pass


SAVER = """
import sys, time
from pathlib import Path
from edgellm.tui.history import Conversation, Message, save_conversation
path = Path(sys.argv[1])
conv = Conversation(messages=[])
i = 0
while True:
    i += 1
    conv.messages = [Message("user", f"turn {i} " + "x" * 200_000)]  # ~200 KB: saves take a while
    save_conversation(conv, path)
    print(i, flush=True)
"""


def test_history_killed_mid_save_keeps_the_last_good_file(tmp_path):
    """SIGKILL at random moments while a process saves a chat over and over: the file on disk always
    parses, and holds a turn the saver had finished (or the one it was writing, once renamed)."""
    from edgellm.tui.history import load_conversation

    path = tmp_path / "chat.json"
    rng = random.Random(7)
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT)
        assert proc.stdout.readline().strip() == "1" or path.is_file()  # at least one save has finished
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        done = [int(x) for x in proc.stdout.read().split()]
        proc.wait()
        conv = load_conversation(path)  # never half-written
        turn = int(conv.messages[0].content.split()[1])
        assert turn >= (max(done) if done else 1) and len(conv.messages[0].content) > 200_000
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "chat.json"]
    assert all(p.startswith(".chat.json.tmp-") for p in leftovers)  # a kill -9 can leave a temp, never a chat
    json.loads(path.read_text())
