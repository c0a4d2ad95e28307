# ruff: noqa  -- a minimal script run with `python -c` in a tight loop; kept to the stdlib calls it times
"""One soak contender: `python soak_contender.py LOCK SENTINEL ENGINE_ID`.

Shared by tests/integration/lock/test_soak.py and benchmarks/lock.py. Each holder
creates an O_EXCL sentinel while it holds the lock; a second live holder would find
it and exit 3 with OVERLAP. A sentinel whose pid is dead, exiting or SIGKILL-pending
was left by a holder killed while holding, and is removed.
"""

import os, random, sys, time
from dynamo_ftctl.lock import FlockLock
path, sentinel = sys.argv[1], sys.argv[2]
lock = FlockLock(path, int(sys.argv[3]))

def alive(pid):
    # Can `pid` still run user code? Not if it is a zombie, exiting (PF_EXITING:
    # its files, and so its flock, are released before it becomes a zombie) or
    # has SIGKILL pending.
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    sigkill = 1 << 8
    pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return fields[0] not in "ZX" and not int(fields[6]) & 0x4 and not pending & sigkill

while True:
    lease = lock.acquire()
    while True:
        try:
            fd = os.open(sentinel, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                other = int(open(sentinel).read() or 0)
            except (OSError, ValueError):
                other = 0
            if other and alive(other):
                print(f"OVERLAP {lease.token} {other}", flush=True)
                sys.exit(3)
            os.unlink(sentinel)  # left by a holder that was killed while holding
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    print(lease.token, flush=True)
    time.sleep(random.random() * 0.002)
    os.unlink(sentinel)
    lock.release()
