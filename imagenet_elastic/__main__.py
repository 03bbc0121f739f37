import os
import signal

from imagenet_elastic.errors import INTERRUPTED_EXIT  # a small module: imported at once

# Ctrl-C while torch imports (seconds) would be swallowed by its C code and break numpy's import half-way (a
# traceback or an error much later): it waits until the imports are done, then exits 130 with nothing to say.
# Not where SIGINT is ignored (a job started with `&` by a script): an ignored signal stays pending while blocked.
held = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
if held:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
try:
    from imagenet_elastic.cli import program
finally:
    if held:
        if signal.SIGINT in signal.sigpending():
            os._exit(INTERRUPTED_EXIT)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

if __name__ == "__main__":
    program()
