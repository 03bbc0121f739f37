"""A `python` whose every command is a fork of one interpreter that has imported torch, torchvision and timm: what a
script that starts python a dozen times one after another (scripts/gpu_checks.sh's parts, scripts/gpu_proof.py's)
runs as PYTHON, and torchrun as its workers' PYTHON_EXEC, without the ~5 s each new interpreter spends importing them
on these CPUs.

    with warm_python.serving(env, folder) as python:   # `python` is an executable file: PYTHON=python
        subprocess.run(["bash", "scripts/gpu_checks.sh", ...], env={**env, "PYTHON": python})

`python [-u] -m MODULE ...`, `python SCRIPT ...`, `python -c CODE ...` and `python - ...` (the script on stdin) run
in a fork of the server, with the caller's arguments, working folder, environment, stdin/stdout/stderr, CPU affinity
and PYTHONPATH; sys.executable is this `python` too, so that the processes they start are forks as well. Signals to
the caller reach the fork, a SIGKILL too (the fork and what it started are killed when the caller is gone); its exit
status (a signal's too) is the caller's. Anything else (another interpreter option, the file descriptors
multiprocessing's spawn passes) runs in a new interpreter. Only those three libraries are imported before the fork,
none of this package: a module that forgets an import of its own still fails as in a new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

PRELOADED = ("torch", "torchvision", "timm")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
SHIM = """#!{python} -S
import sys
sys.path.insert(0, {tests!r})
import warm_python
warm_python.client({socket!r}, {python!r})
"""


@contextlib.contextmanager
def serving(env: dict[str, str], folder: Path):
    """A server started with `env` (what its imports read), and the executable that forks it: `folder/python`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = f"imagenet-elastic-warm-python-{uuid.uuid4().hex}"  # an abstract socket's: no file, no length to mind
    server = subprocess.Popen([sys.executable, __file__, path], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready", "the warm python did not start"
        shim = folder / "python"
        shim.write_text(SHIM.format(python=sys.executable, tests=str(Path(__file__).parent), socket=path))
        shim.chmod(0o755)
        yield str(shim)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# ----------------------------------------------------------------------------- the caller's side (no torch here)

def client(path: str, python: str) -> None:
    argv, env = sys.argv[1:], dict(os.environ)
    while argv[:1] == ["-u"]:  # unbuffered, as torchrun starts its workers
        argv, env["PYTHONUNBUFFERED"] = argv[1:], "1"
    forms = argv and (argv[0] in ("-m", "-c") and len(argv) > 1 or argv[0] == "-" or not argv[0].startswith("-"))
    if not forms or extra_fds():
        os.execv(python, [python, *sys.argv[1:]])  # a new interpreter, as without the server
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + path)
    except OSError:
        os.execv(python, [python, *sys.argv[1:]])
    request = {"argv": argv, "cwd": os.getcwd(), "env": env, "cpus": sorted(os.sched_getaffinity(0)),
               "executable": sys.argv[0]}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _: conn.sendall(f"signal {s}\n".encode()))
    reply = b""
    while not reply.endswith(b"\n"):
        try:
            chunk = conn.recv(64)
        except InterruptedError:
            continue
        if not chunk:
            os._exit(1)
        reply += chunk
    code = int(reply.split()[-1])
    if code < 0:  # ended by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    os._exit(code & 0xFF)


def extra_fds() -> bool:
    """File descriptors past stderr that a child inherits (multiprocessing's spawn passes its pipes so)."""
    return any(int(fd) > 2 and os.get_inheritable(int(fd)) for fd in os.listdir("/proc/self/fd")
               if fd.isdigit() and os.path.exists(f"/proc/self/fd/{fd}"))


# ----------------------------------------------------------------------------- the server's side

def serve(path: str) -> None:
    for module in PRELOADED:
        __import__(module)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + path)
    listener.listen(16)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    try:
        while True:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                handle(conn, base_path)
            conn.close()
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
    finally:  # every command waited for: their CPU time is this process's children's, and so its caller's
        listener.close()
        with contextlib.suppress(ChildProcessError):
            while True:
                os.waitpid(-1, 0)
        os._exit(0)  # without the interpreter's seconds of tearing torch down


def handle(conn: socket.socket, base_path: list[str]) -> None:
    """One command: a fork runs it; this process passes signals on and reports how it ended."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not message.endswith(b"\n"):
        message += conn.recv(1 << 20)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        conn.close()
        run(request, fds, base_path)
    for fd in fds:
        os.close(fd)
    pending = b""
    while True:
        ready, _, _ = select.select([conn], [], [], 0.02)
        if ready:
            chunk = conn.recv(64)
            if not chunk:  # the caller is gone (SIGKILL): so is the command, with what it started
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os._exit(0)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, int(line.split()[1]))
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)


def run(request: dict, fds: list[int], base_path: list[str]) -> None:
    """The command, in this fork, as `python ARGV` would run it; then exit as that interpreter would."""
    import atexit
    import io
    import runpy
    import threading
    import traceback
    import types

    os.setpgid(0, 0)  # what it starts goes with it if the caller is killed
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.sched_setaffinity(0, request["cpus"])
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "rb", closefd=False)))
    stdout = io.FileIO(1, "wb", closefd=False)
    sys.stdout = io.TextIOWrapper(stdout if unbuffered else io.BufferedWriter(stdout), write_through=unbuffered,
                                  line_buffering=not unbuffered and os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "wb", closefd=False), write_through=True, errors="backslashreplace")
    sys.executable = request["executable"]
    argv = request["argv"]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [os.getcwd(), *pythonpath, *base_path]
            runpy._run_module_as_main(argv[1], alter_argv=True)
        else:
            if argv[0] in ("-c", "-"):
                source, name = (argv[1], "<string>") if argv[0] == "-c" else (sys.stdin.read(), "<stdin>")
                sys.argv = [argv[0], *argv[2 if argv[0] == "-c" else 1:]]
                sys.path[:] = ["", *pythonpath, *base_path]
            else:
                name = argv[0]
                source = Path(name).read_text()
                main.__dict__["__file__"] = name
                sys.argv = list(argv)
                sys.path[:] = [os.path.dirname(os.path.realpath(name)), *pythonpath, *base_path]
            sys.modules["__main__"] = main
            exec(compile(source, name, "exec"), main.__dict__)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


if __name__ == "__main__":
    serve(sys.argv[1])
