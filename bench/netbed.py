"""A multi-host test bed on one machine: network namespaces as hosts, each with its own address on
a bridge, and a bandwidth cap on every host's link (tc tbf), so a torchrun job with --nnodes
crosses a real (namespaced) network. Needs root and iproute2; nothing leaves the machine (the
addresses are the namespaces' own, on a bridge with no uplink).

    with NetBed(hosts=2, rate="1gbit") as bed:
        procs = [bed.popen(h, bed.torchrun(h, nproc=2, script=[...])) for h in range(bed.hosts)]
        bed.tx_bytes(0)   # what host 0 sent over its link (the veth's counter)

The kernel here has no netem, so the link gets a rate and no added delay (tbf only queues).
"""

import os
import shutil
import subprocess


def unavailable() -> str | None:
    """Why this machine cannot build the bed (None if it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"zkprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args, ns=None):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"netbed: {' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout


class NetBed:
    """`hosts` namespaces on one bridge, host h at 10.213.<net>.<h + 1>, its egress capped at `rate`
    (a tc rate, e.g. "1gbit"; None: no cap)."""

    def __init__(self, hosts=2, rate="1gbit", burst="256kb"):
        self.hosts, self.rate, self.burst = hosts, rate, burst
        tag = f"zk{os.getpid() % 100000:x}"  # interface names: 15 characters at most
        self.bridge = f"{tag}-br"
        self.ns = [f"{tag}-h{h}" for h in range(hosts)]
        self.dev = [f"{tag}-p{h}" for h in range(hosts)]  # each host's end of its veth pair
        self._root_end = [f"{tag}-v{h}" for h in range(hosts)]
        self.net = 1 + os.getpid() % 250
        self.addr = [f"10.213.{self.net}.{h + 1}" for h in range(hosts)]

    def __enter__(self):
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            _ip("ip", "link", "set", self.bridge, "up")
            for h in range(self.hosts):
                ns, dev, root = self.ns[h], self.dev[h], self._root_end[h]
                _ip("ip", "netns", "add", ns)
                _ip("ip", "link", "add", root, "type", "veth", "peer", "name", dev)
                _ip("ip", "link", "set", dev, "netns", ns)
                _ip("ip", "addr", "add", f"{self.addr[h]}/24", "dev", dev, ns=ns)
                _ip("ip", "link", "set", dev, "up", ns=ns)
                _ip("ip", "link", "set", "lo", "up", ns=ns)
                _ip("ip", "link", "set", root, "master", self.bridge)
                _ip("ip", "link", "set", root, "up")
                if self.rate:
                    _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", self.burst,
                        "latency", "100ms", ns=ns)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its veth pair along
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def torchrun(self, host, nproc, script, rdzv_port=29400, job="zk", restarts=0, monitor_interval=None):
        """The command that starts host `host`'s part of a --nnodes job (c10d rendezvous hosted by
        host 0; --local-addr, as the namespaces share one hostname; --max-restarts=restarts;
        --monitor-interval if given: how often torchrun polls its workers, 0.1 s by default)."""
        import sys

        monitor = [] if monitor_interval is None else [f"--monitor-interval={monitor_interval}"]
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.hosts}", f"--node-rank={host}",
                f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", *monitor, "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.addr[0]}:{rdzv_port}", f"--rdzv-id={job}", f"--local-addr={self.addr[host]}",
                f"--rdzv-conf=is_host={'true' if host == 0 else 'false'},join_timeout=60", *script]

    def popen(self, host, cmd, env=None, **kw):
        """cmd run inside host `host`, gloo bound to its interface."""
        env = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME=self.dev[host])
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *cmd], env=env, **kw)

    def tx_bytes(self, host) -> int:
        """Bytes host `host` has sent over its link (the veth's counter)."""
        return int(_ip("cat", f"/sys/class/net/{self.dev[host]}/statistics/tx_bytes", ns=self.ns[host]))
