"""Running a piece of a test in another real process."""

import os


def in_forked_child(action) -> str:
    """Run ``action()`` in a forked child: the string it returned, or ``"<ErrorType>: <message>"``
    of what it raised. The parent reads the child's answer to the end before reaping it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            try:
                message = str(action())
            except BaseException as error:
                message = f"{type(error).__name__}: {error}"
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message
