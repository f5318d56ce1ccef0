"""A fake training program, the workload of the runner's unit tests and of Molecule ``launch`` and ``patrol``.

    fake_train.py [--epochs N] [--steps-per-epoch M] [--step-s S] [--out DIR] [--ckpt-kib K]
                  [--crash | --crash-at-epoch E] [--cuda-oom] [--exit CODE] [--signal-self SIG] [--hang] [--forever]
                  [--ignore-sigterm] [--nan] [--fill-disk [--fill-limit-mib N]] [--silent] [--stop-file PATH]
                  [--fork-children N [--child-s S] [--child-term-delay S]] [--record FILE]
                  [--print-env NAME ...] [--show-env NAME ...]
                  [--layout pth|plain|lightning|hf] [--nan-weights] [--truncate-best] [--detach-helper S]
                  [--starts-file FILE]

It prints ``epoch i/N step j/M loss x`` lines (the progress patrol reads), writes ``latest.pth`` every epoch and
``best.pth`` when the loss improves (random bytes, ``--ckpt-kib`` each) into ``--out`` (alias ``--ckpt``; default
$RGT_CELL_DIR, else the working directory). Small and fast by default: two epochs of three 10 ms steps.

``--crash`` raises a real exception (a Python traceback) at ``--crash-at-epoch`` (default 1); ``--cuda-oom`` prints,
at the same point, the traceback PyTorch prints when the CUDA allocator runs out of memory
(``torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...``) and exits 1.

``--silent`` trains (steps, checkpoints) while printing nothing, as frameworks that write only when an epoch or the
whole fit ends. ``--stop-file PATH`` ends the training, as a success, after the step during which PATH appeared
(with ``--forever``: a run that ends when the test says so).

``--print-env`` proves a variable reached the job without writing its value (it may be a secret): it prints the
first 16 hex digits of its sha256. ``--show-env`` prints the value itself (for CUDA_VISIBLE_DEVICES and the like).
``--record`` appends JSON lines ``{event, ts, pid, cell, gpus}`` (start, end, child_exit): the tests' independent
view of when a cell's processes lived. Standard library only: it runs on the fleet's bare system Python.

``--layout`` picks what the checkpoints look like (default ``pth``: the ``latest.pth`` / ``best.pth`` above):

- ``plain`` (a plain PyTorch loop): ``last.pt`` every epoch, ``best.pt`` when the loss improves.
- ``lightning``: ``checkpoints/epoch=E-step=S.ckpt`` (only the newest kept, E counted from 0) and
  ``checkpoints/last.ckpt``.
- ``hf`` (Hugging Face Trainer): a directory ``checkpoint-<step>/`` per epoch (``model.safetensors``,
  ``optimizer.pt``, ``trainer_state.json``), then ``model.safetensors`` and ``config.json`` in ``--out``.

The ``.pt`` / ``.ckpt`` files are pickle-free containers (``CKPT_MAGIC``, the payload's length, the payload, its
sha256) that tests/workload/load_check.py checks; ``model.safetensors`` is a real safetensors file (one F32
tensor), with a NaN in the final one under ``--nan-weights``. ``--truncate-best`` cuts the last ``best.pt`` /
``best.pth`` to half its size and still exits 0, as a disk that filled up during ``torch.save`` leaves it under a
loop that does not check the save. ``--detach-helper S`` starts ``sleep S`` with an empty environment in a session
of its own (``env -i setsid sleep S &``: no marker of the run) and writes its pid to ``helper.pid`` in ``--out``.
``--starts-file`` appends one line per start of the program (``start <cell> <pid>``): a test's proof that a cell
was, or was not, trained again.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from typing import List, Optional


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=3)
    parser.add_argument("--step-s", "--sleep", dest="step_s", type=float, default=0.01, help="seconds per step")
    parser.add_argument("--out", "--ckpt", dest="out", default=None, help="checkpoint directory")
    parser.add_argument("--ckpt-kib", type=int, default=4)
    parser.add_argument("--crash", action="store_true", help="a Python traceback at --crash-at-epoch (default 1)")
    parser.add_argument("--crash-at-epoch", type=int, default=None)
    parser.add_argument("--cuda-oom", action="store_true", help="a CUDA out-of-memory traceback at --crash-at-epoch")
    parser.add_argument("--exit", dest="exit_code", type=int, default=0, help="exit status after training")
    parser.add_argument("--signal-self", type=int, default=None, help="die by this signal after training")
    parser.add_argument("--hang", action="store_true", help="stop printing after the first step and sleep")
    parser.add_argument("--forever", action="store_true", help="train forever")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--nan", action="store_true", help="print a NaN loss")
    parser.add_argument("--silent", action="store_true", help="train while printing nothing")
    parser.add_argument("--stop-file", default=None, help="end the training once this file exists")
    parser.add_argument("--fill-disk", action="store_true", help="save until the disk is full (ENOSPC)")
    parser.add_argument("--fill-limit-mib", type=int, default=None, help="simulate ENOSPC after this many MiB")
    parser.add_argument("--fork-children", type=int, default=0, help="children that outlive the program")
    parser.add_argument("--child-s", type=float, default=30.0, help="how long each child lives")
    parser.add_argument("--child-term-delay", type=float, default=0.0, help="seconds a child takes to die on TERM")
    parser.add_argument("--record", default=None, help="append JSON event lines to this file")
    parser.add_argument("--print-env", nargs="+", default=[], metavar="NAME")
    parser.add_argument("--show-env", nargs="+", default=[], metavar="NAME")
    parser.add_argument("--layout", choices=LAYOUTS, default="pth", help="what the checkpoints look like")
    parser.add_argument("--nan-weights", action="store_true", help="a NaN in the final model.safetensors (hf)")
    parser.add_argument("--truncate-best", action="store_true", help="cut the last best checkpoint to half its size")
    parser.add_argument("--detach-helper", type=float, default=None, metavar="S", help="env -i setsid sleep S &")
    parser.add_argument("--starts-file", default=None, help="append a line to this file at each start")
    return parser.parse_args(argv)


def _record(path: Optional[str], event: str) -> None:
    if not path:
        return
    line = json.dumps(
        {
            "event": event,
            "ts": time.time(),
            "pid": os.getpid(),
            "cell": os.environ.get("RGT_CELL"),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _child(args: argparse.Namespace, index: int, ready: int) -> None:
    """A worker left behind: every second one leaves the session (as some launchers' daemons do)."""
    if index % 2 == 1:
        os.setsid()

    def on_term(signum: int, frame: object) -> None:
        time.sleep(args.child_term_delay)
        _record(args.record, "child_exit")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    os.write(ready, b".")  # only now may the program end: a SIGTERM before this would leave no record
    os.close(ready)
    time.sleep(args.child_s)
    _record(args.record, "child_exit")
    os._exit(0)


def _fork_children(args: argparse.Namespace) -> None:
    for index in range(args.fork_children):
        sys.stdout.flush()
        ready_read, ready_write = os.pipe()
        if os.fork() == 0:
            try:
                os.close(ready_read)
                _child(args, index, ready_write)
            finally:
                os._exit(0)
        os.close(ready_write)
        os.read(ready_read, 1)  # the child has left the session if it is to, and handles SIGTERM
        os.close(ready_read)


def _save(directory: str, name: str, kib: int) -> None:
    path = os.path.join(directory, name)
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as handle:
        handle.write(os.urandom(kib * 1024))
    os.replace(temporary, path)


def _fill_disk(directory: str, limit_mib: Optional[int]) -> None:
    chunk = os.urandom(1024 * 1024)
    written = 0
    with open(os.path.join(directory, "fill.bin"), "wb") as handle:
        while True:
            if limit_mib is not None and written >= limit_mib:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), handle.name)
            handle.write(chunk)
            handle.flush()
            written += 1


LAYOUTS = ("pth", "plain", "lightning", "hf")
# The checkpoint container of --layout plain / lightning / hf (load_check.py reads it): magic, payload length
# (big-endian u64), payload, sha256 of the payload. A cut file shows as a length or digest mismatch.
CKPT_MAGIC = b"RGTCKPT1"


def _write(path: str, data: bytes) -> None:
    """Atomically, as torch.save to a temp name and a rename would."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as handle:
        handle.write(data)
    os.replace(temporary, path)


def container(payload: bytes) -> bytes:
    return CKPT_MAGIC + struct.pack(">Q", len(payload)) + payload + hashlib.sha256(payload).digest()


def safetensors(values: List[float]) -> bytes:
    """A safetensors file holding one F32 tensor ``weight``: u64 header length, JSON header, raw data."""
    data = struct.pack(f"<{len(values)}f", *values)
    weight = {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, len(data)]}
    header = {"__metadata__": {"format": "pt"}, "weight": weight}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header with spaces to 8 bytes
    return struct.pack("<Q", len(encoded)) + encoded + data


def _weights(kib: int, nan: bool = False) -> List[float]:
    values = [random.uniform(-1.0, 1.0) for _index in range(max(1, kib * 256))]
    if nan:
        values[len(values) // 2] = float("nan")
    return values


def _save_epoch(args: argparse.Namespace, out: str, epoch: int, improved: bool) -> None:
    """One epoch's checkpoints in the layout asked for."""
    step = epoch * args.steps_per_epoch

    def payload() -> bytes:
        return os.urandom(args.ckpt_kib * 1024)

    if args.layout == "pth":
        _save(out, "latest.pth", args.ckpt_kib)
        if improved:
            _save(out, "best.pth", args.ckpt_kib)
    elif args.layout == "plain":
        _write(os.path.join(out, "last.pt"), container(payload()))
        if improved:
            _write(os.path.join(out, "best.pt"), container(payload()))
    elif args.layout == "lightning":
        directory = os.path.join(out, "checkpoints")
        name = f"epoch={epoch - 1}-step={step}.ckpt"
        _write(os.path.join(directory, name), container(payload()))
        for old in os.listdir(directory):  # ModelCheckpoint(save_top_k=1): only the newest epoch file stays
            if old.startswith("epoch=") and old.endswith(".ckpt") and old != name:
                os.remove(os.path.join(directory, old))
        _write(os.path.join(directory, "last.ckpt"), container(payload()))
    else:
        directory = os.path.join(out, f"checkpoint-{step}")
        _write(os.path.join(directory, "model.safetensors"), safetensors(_weights(args.ckpt_kib)))
        _write(os.path.join(directory, "optimizer.pt"), container(payload()))
        state = {"global_step": step, "epoch": float(epoch)}
        _write(os.path.join(directory, "trainer_state.json"), json.dumps(state).encode())


def _save_final(args: argparse.Namespace, out: str) -> None:
    """What the end of a fit writes (hf: trainer.save_model), then a best checkpoint cut short if asked."""
    if args.layout == "hf":
        _write(os.path.join(out, "model.safetensors"), safetensors(_weights(args.ckpt_kib, args.nan_weights)))
        _write(os.path.join(out, "config.json"), json.dumps({"model_type": "fake", "hidden_size": 8}).encode())
    best = {"pth": "best.pth", "plain": "best.pt"}.get(args.layout)
    if args.truncate_best and best and os.path.exists(os.path.join(out, best)):
        path = os.path.join(out, best)
        os.truncate(path, os.path.getsize(path) // 2)


def _start_helper(seconds: float, out: str) -> None:
    """``env -i setsid sleep S &``: no environment (so no run marker), its own session, never waited for."""
    helper = subprocess.Popen(
        [shutil.which("sleep") or "/bin/sleep", f"{seconds:g}"], env={}, start_new_session=True, close_fds=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    with open(os.path.join(out, "helper.pid"), "w") as handle:
        handle.write(f"{helper.pid}\n")
    print(f"helper pid {helper.pid}", flush=True)


def _append_start(path: Optional[str]) -> None:
    if path:
        with open(path, "a") as handle:
            handle.write(f"start {os.environ.get('RGT_CELL', '-')} {os.getpid()}\n")


# What PyTorch 2.x prints when the caching allocator cannot satisfy a request (the frames are a typical
# training script's; the message is torch's own wording).
CUDA_OOM_TRACEBACK = """Traceback (most recent call last):
  File "/root/code/train.py", line 214, in <module>
    main()
  File "/root/code/train.py", line 189, in main
    outputs = model(**batch)
              ^^^^^^^^^^^^^^
  File "/usr/local/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1532, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/usr/local/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1541, in _call_impl
    return forward_call(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/root/code/model.py", line 88, in forward
    attn = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)
                         ~~^~~~~~~~~~~~~~~~~~~~~
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB \
of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.03 GiB memory in use. Of the allocated \
memory 75.12 GiB is allocated by PyTorch, and 1.41 GiB is reserved by PyTorch but unallocated. If reserved but \
unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  \
See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
"""


def _show_environment(args: argparse.Namespace) -> None:
    for name in args.print_env:
        value = os.environ.get(name)
        proof = "unset" if value is None else "sha256=" + hashlib.sha256(value.encode()).hexdigest()[:16]
        print(f"env {name} {proof}")
    for name in args.show_env:
        print(f"env {name}={os.environ.get(name, '<unset>')}")


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = args.out or os.environ.get("RGT_CELL_DIR") or os.getcwd()
    os.makedirs(out, exist_ok=True)
    _record(args.record, "start")
    _append_start(args.starts_file)
    _show_environment(args)
    _fork_children(args)
    if args.detach_helper is not None:
        _start_helper(args.detach_helper, out)
    crash_at = args.crash_at_epoch if args.crash_at_epoch is not None else (1 if args.crash or args.cuda_oom else None)
    best = math.inf
    epoch = 0
    while args.forever or epoch < args.epochs:
        epoch += 1
        if crash_at is not None and epoch >= crash_at and args.cuda_oom:
            sys.stdout.flush()
            sys.stderr.write(CUDA_OOM_TRACEBACK)
            sys.stderr.flush()
            return 1
        if crash_at is not None and epoch >= crash_at:
            raise RuntimeError(f"fake_train: crashed at epoch {epoch} as asked")
        for step in range(1, args.steps_per_epoch + 1):
            loss = float("nan") if args.nan else 1.0 / (epoch * args.steps_per_epoch + step) + random.random() * 1e-3
            total = "inf" if args.forever else str(args.epochs)
            if not args.silent:
                print(f"epoch {epoch}/{total} step {step}/{args.steps_per_epoch} loss {loss:.4f}", flush=True)
            if args.hang:
                while True:
                    time.sleep(3600)
            time.sleep(args.step_s)
            if args.stop_file and os.path.exists(args.stop_file):
                break
        if args.fill_disk:
            _fill_disk(out, args.fill_limit_mib)
        improved = epoch == 1 or loss < best  # a NaN loss never improves on the first epoch's checkpoint
        if improved:
            best = loss
        _save_epoch(args, out, epoch, improved)
        if args.stop_file and os.path.exists(args.stop_file):
            break  # the epoch was cut short at the step the file appeared; its checkpoints are saved
    _save_final(args, out)
    _record(args.record, "end")
    sys.stdout.flush()
    if args.signal_self is not None:
        os.kill(os.getpid(), args.signal_self)
        time.sleep(5)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
