#!/usr/bin/env python3
"""Where one connection's hop goes, read from the kernel's timestamps (bench/hop-trace.sh).

usage: hop-trace.py SYSCALLS.txt WAKEUPS.txt TIDS

SYSCALLS.txt is `perf script --ns` of the proxy's syscall tracepoints, WAKEUPS.txt of the
machine's `sched:sched_wakeup` over the same seconds, TIDS the proxy's thread ids (a,b,...). Prints, for the thread that served the connection, the median
time between the syscalls of one request (user-space work between them, the sends, the
sleeps), syscalls per request, and how the proxy's threads were woken.
"""
import re
import statistics
import sys
from collections import Counter, defaultdict

SYSCALL = re.compile(
    r"\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+syscalls:sys_(enter|exit)_(\w+):\s*(.*)"
)
# The syscalls that send: the answer to the client, the request to the upstream.
SENDS = ("writev", "sendto", "write")
WAKEUP = re.compile(
    r"\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_wakeup:\s+comm=(\S+) pid=(\d+) .*target_cpu=(\d+)"
)


def main(sys_path, wake_path, tids):
    tids = {int(t) for t in tids.split(',') if t}
    events = []
    for line in open(sys_path):
        m = SYSCALL.match(line)
        if not m:
            continue
        _, tid, cpu, t, edge, call, rest = m.groups()
        fd = re.search(r"fd: (0x[0-9a-f]+)", rest)
        ret = rest.strip()
        events.append(
            (int(tid), int(cpu), float(t) * 1e6, edge, call, int(fd.group(1), 16) if fd else None, ret)
        )
    if not events:
        sys.exit("no syscalls traced (is perf allowed to read tracepoints?)")
    # The serving thread: the one that wrote most.
    writes = Counter(e[0] for e in events if e[3] == "enter" and e[4] in SENDS)
    tid = writes.most_common(1)[0][0]
    seq = [e for e in events if e[0] == tid]
    # The two sockets of the connection: the client's gets the answer, larger than the
    # request the upstream gets (bytes sent per file descriptor); each syscall is named by
    # the socket it is on.
    sent, last = Counter(), None
    for _, _, _, edge, call, fd, ret in seq:
        if call in SENDS:
            if edge == "enter":
                last = fd
            elif last is not None and ret.startswith("0x"):
                sent[last] += int(ret.split()[0], 16)
    if len(sent) < 2:
        sys.exit("too few requests traced")
    (client_fd, _), (upstream_fd, _) = sent.most_common(2)
    role = {client_fd: "client", upstream_fd: "upstream"}
    names, last_fd = [], None
    for _, _, _, edge, call, fd, ret in seq:
        if edge == "enter" and fd is not None:
            last_fd = fd
        who = role.get(fd if edge == "enter" else last_fd, "other")
        if call == "epoll_wait":
            names.append(f"{edge} epoll_wait")
        else:
            names.append(f"{edge} {call} ({who})")
    gaps = defaultdict(list)
    for i in range(1, len(seq)):
        gaps[(names[i - 1], names[i])].append(seq[i][2] - seq[i - 1][2])
    n_req = sum(
        1 for e in seq if e[3] == "enter" and e[4] in SENDS and e[5] == client_fd
    )
    span = seq[-1][2] - seq[0][2]
    print(f"serving thread {tid}: {n_req} answers in {span / 1e6:.2f} s, "
          f"{sum(1 for i in range(1, len(seq)) if seq[i][1] != seq[i - 1][1])} changes of core")
    print("| from | to | per request | median µs | mean µs |")
    print("| --- | --- | --- | --- | --- |")
    rows = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))
    for (a, b), v in rows:
        if len(v) < n_req / 20:
            continue
        print(f"| {a} | {b} | {len(v) / n_req:.2f} | {statistics.median(v):.1f} | {statistics.mean(v):.1f} |")
    calls = Counter(e[4] for e in seq if e[3] == "enter")
    print("syscalls per request: " + ", ".join(f"{c} {k / n_req:.2f}" for c, k in calls.most_common()))

    wakes = Counter()
    for line in open(wake_path):
        m = WAKEUP.match(line)
        if not m:
            continue
        waker, _, cpu, _, _, wakee, target = m.groups()
        if int(wakee) not in tids:
            continue
        # A wake-up sent to another core runs there, from its idle loop (`swapper`), when the
        # wakee's core received the interrupt; one made on the wakee's own core names the waker.
        remote = waker.strip().startswith("swapper") or int(cpu) != int(target)
        wakes["another core" if remote else "the waker's core"] += 1
    total = sum(wakes.values())
    if total:
        print(f"wake-ups of the proxy's threads: {total / n_req:.2f} per request, " + ", ".join(
            f"on {k}: {v * 100 / total:.0f} %" for k, v in wakes.most_common()))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3])
