"""The one live-storage core (trace/storages.py) and the trackers built on it: a storage counts at
its current size, dies with its last reference, and is read through a DTensor's local shard."""

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from trainmem.trace import trace  # noqa: E402
from trainmem.trace.live import LiveStorages  # noqa: E402
from trainmem.trace.storages import StorageTracker, storage_key  # noqa: E402


def test_live_bytes_follow_weak_references():
    freed = []
    s = StorageTracker(on_free=lambda e: freed.append(e.nbytes))
    a, b = torch.empty(100), torch.empty(50, dtype=torch.float16)
    s.add(a)
    s.add(b)
    s.add(a[10:])  # a view: the same storage, counted once
    assert s.live_bytes == 100 * 4 + 50 * 2  # 400 + 100 = 500
    ref = a.untyped_storage()
    key = storage_key(a)
    del a, ref
    assert s.live_bytes == 100 and freed == [400] and key not in s.entries
    assert s.peak_bytes == 500


def test_tracking_never_extends_a_lifetime():
    import weakref

    s = StorageTracker()
    t = torch.empty(10)
    s.add(t)
    alive = weakref.ref(t)
    del t
    assert alive() is None and s.live_bytes == 0


def test_granularity_rounds_every_storage():
    s = StorageTracker(granularity=512)
    a, b = torch.empty(1), torch.empty(129)  # 4 B and 516 B
    s.add(a)
    s.add(b)
    assert s.live_bytes == 512 + 1024


def test_an_op_output_rereads_its_storage_size():
    s = StorageTracker()
    x = torch.empty(10)  # 40 B
    s.add(x)
    x.resize_(1000)  # 4,000 B
    s.add(x)
    x.resize_(0)  # PyTorch never shrinks a storage through Tensor.resize_: still 4,000 B
    s.add(x)
    assert s.live_bytes == 4000 and s.peak_bytes == 4000
    x.untyped_storage().resize_(8)  # UntypedStorage.resize_ does shrink
    s.add(x)
    assert s.live_bytes == 8 and s.peak_bytes == 4000


def test_untyped_resize_is_followed_for_resizable_storages_only():
    s = StorageTracker()
    watched, plain = torch.empty(100), torch.empty(100)  # 400 B each
    s.add(watched, resizable=True)
    s.add(plain)
    watched.untyped_storage().resize_(0)
    plain.untyped_storage().resize_(0)  # not seen: it is not resizable and no op outputs it
    s.refresh()
    assert s.live_bytes == 400
    watched.untyped_storage().resize_(1000)
    s.refresh()
    assert s.live_bytes == 1400 and s.peak_bytes == 1400


def test_refresh_applies_shrinks_before_growth():
    """An FSDP2 reshard and the next unshard seen at once must not count both."""
    s = StorageTracker()
    a, b = torch.empty(250), torch.empty(0)  # 1,000 B and 0 B
    s.add(a, resizable=True)
    s.add(b, resizable=True)
    s.reset_peak()
    a.untyped_storage().resize_(0)
    b.untyped_storage().resize_(1000)
    s.refresh()
    assert s.live_bytes == 1000 and s.peak_bytes == 1000


def test_take_peak_starts_a_new_interval():
    s = StorageTracker()
    big = torch.empty(1000)  # 4,000 B
    s.add(big)
    del big
    assert s.take_peak() == 4000
    small = torch.empty(10)
    s.add(small)
    assert s.take_peak() == 40 and s.peak_bytes == 4000


def test_live_storages_count_a_storage_at_its_current_size():
    """The CPU meter used to keep a regrown storage at its largest size until it died."""
    x = torch.empty(1000)  # 4,000 B, made before: the baseline
    with LiveStorages([x]) as live:
        y = torch.empty(10)  # 40 B
        x.untyped_storage().resize_(0)
        x.resize_(10)  # aten.resize_: the op output re-reads x's storage, now 40 B
        assert live.now == 40 + 40
    assert live.peak == 4000 + 40
    del y


def test_the_tracer_records_a_resize_as_a_free_and_an_allocation():
    x = torch.empty(0)
    a = torch.ones(1000)  # 4,000 B
    with trace(inputs=[a]) as t:
        torch.add(a, a, out=x)  # aten.add.out resizes x from 0 to 4,000 B
        x.resize_(2000)  # 8,000 B: a new block, the old one freed
    blocks = t.result.recording.blocks
    grown = [b for b in blocks if b.op in ("add", "resize_")]
    assert [(b.op, b.nbytes) for b in grown] == [("add", 4000), ("resize_", 8000)]
    assert grown[0].free_at == grown[1].alloc_at + 1  # freed just after the larger block is allocated
    # a and x's 8,000 B block, each a multiple of 512: 4,096 + 8,192 (the 4,000 B block is gone)
    assert t.result.timeline_allocated_bytes[-1] == 4096 + 8192


@pytest.mark.slow  # 10-30 s on 2 shared cores: the default run is at its 10-minute budget
@pytest.mark.distributed
def test_dtensor_is_read_through_its_local_shard(tmp_path):
    """A real DTensor on a 2-rank gloo mesh (two processes): the tracker sees the local shard's bytes."""
    script = textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from trainmem.trace.storages import StorageTracker
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        d = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])  # 32 x 8 fp32 per rank
        s = StorageTracker()
        s.add(d)
        print(s.live_bytes)
        dist.destroy_process_group()
    """)
    path = tmp_path / "dtensor.py"
    path.write_text(script)
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(path), str(r), str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]  # two torch imports on a busy machine
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.split() == [str(32 * 8 * 4)]  # 1,024 B: half the rows
