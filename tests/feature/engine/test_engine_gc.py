"""An engine whose model is dropped without infinity.unwrap is garbage-collected with it: its
swap files are closed and removed, and repeated wraps do not pile up open files. (A
parameter's gradient hook lives in C++, where the garbage collector cannot see it; the hook
must not hold anything that reaches the model.) Runs in a subprocess for a clean fd count."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, os, sys, tempfile, time, weakref
    import torch, infinity
    from infinity.models import GPTConfig, TinyGPT, lm_loss

    def fds():
        return len(os.listdir("/proc/self/fd"))

    def train_and_drop(tier, path):
        model = infinity.wrap(TinyGPT(GPTConfig(n_layers=2)), nvme_path=path, param_tier=tier,
                              grad_tier="nvme" if tier == "nvme" else "host",
                              optimizer_tier="nvme" if tier == "nvme" else "host")
        opt = infinity.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 512, (2, 16))
        for _ in range(2):
            lm_loss(model(x), x).backward(); opt.step(); opt.zero_grad()
        return weakref.ref(infinity.api._engine(model))

    # the I/O engine's process-wide descriptors (io_uring rings and their eventfd) open with
    # its first request and stay: start it before counting
    import infinity.io as io
    with io.FileHandle(os.path.join(tempfile.mkdtemp(), "warm.bin"), "w+") as f:
        f.write(io.aligned_empty(1 << 16))
    def settled(done):
        # a background I/O thread may hold the last reference to a store for the moment it
        # takes to drop the request it just finished: give it a few seconds, no more
        deadline = time.monotonic() + 10.0
        while not done() and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.02)
        return done()

    base = fds()
    for tier in ("host", "nvme", "nvme", "nvme"):
        path = tempfile.mkdtemp()
        ref = train_and_drop(tier, path)
        gc.collect()
        if ref() is not None:
            sys.exit(f"the {tier} engine is still alive after its model was dropped")
        if not settled(lambda: not os.listdir(path)):
            sys.exit(f"swap files left in {path}: {os.listdir(path)}")
    if not settled(lambda: fds() == base):
        sys.exit(f"open files: {base} before, {fds()} after four dropped engines")
    print("ok")
""")


def test_dropped_engines_are_collected_and_close_their_files():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        proc.stdout[-2000:] + proc.stderr[-3000:])
