"""The peak of the tensors alive during a call, from TensorFlow's profiler.

TensorFlow's CPU allocator statistics (`tf.config.experimental.get_memory_info`,
with `TF_CPU_ALLOCATOR_USE_BFC=true`) count the allocator's chunks, not the
tensors in them: the BFC allocator hands an 8 MiB tensor a 12.6 MiB chunk
when no chunk closer in size is free, and keeps the rest unused. Which chunks
are free depends on what ran before, so the same step of the same model read
20.1 MiB in one process and 24.4 MiB in another (bench/privacy.py's CNN,
stock `fit`). And TensorFlow's default CPU allocator, outside the bench, is
not BFC at all.

`live_tensor_peak` reads the profiler's memory events instead: every
allocation and deallocation during the call, with the bytes each tensor
requested, and returns the largest sum of the requested bytes of the
tensors allocated during the call and alive at one time (what the
computation needs, independent of the allocator's chunking), with the
largest of them at that moment.
"""

import glob
import os
import tempfile

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2


def live_tensor_peak(fn, top=0):
    """`fn()` under the profiler: the peak MiB of the tensors it allocated and held.

    Args:
        fn: zero-argument callable (already traced: tracing allocates too).
        top: how many of the largest tensors alive at the peak to return.

    Returns:
        `(peak_mib, largest)`: `largest` lists `(mib, op_name, shape)` of the
        `top` largest tensors alive at the peak.

    Example:
    ```python
    peak, largest = live_tensor_peak(lambda: model.train_on_batch(x, y), top=5)
    ```
    """
    with tempfile.TemporaryDirectory() as logdir:
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=3)
        tf.profiler.experimental.start(logdir, options=options)
        try:
            fn()
        finally:
            tf.profiler.experimental.stop()
        (path,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        space = xplane_pb2.XSpace()
        with open(path, "rb") as file:
            space.ParseFromString(file.read())
    live, current, peak, at_peak = {}, 0, 0, {}
    for _, name, stats in sorted(_memory_events(space), key=lambda event: event[0]):
        address = stats.get("addr")
        if name == "MemoryAllocation":
            size = stats.get("requested_bytes", 0)
            live[address] = (size, stats.get("tf_op", "?"), stats.get("shape", "?"))
            current += size
            if current > peak:
                peak, at_peak = current, dict(live)
        elif address in live:  # buffers from before the call are not counted
            current -= live.pop(address)[0]
    largest = sorted(at_peak.values(), key=lambda entry: -entry[0])[:top]
    return peak / 2**20, [(size / 2**20, op, shape) for size, op, shape in largest]


def _memory_events(space):
    """`(time_ps, name, stats)` of every allocation and deallocation event."""
    for plane in space.planes:
        events = {key: meta.name for key, meta in plane.event_metadata.items()}
        stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = events.get(event.metadata_id)
                if name not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for stat in event.stats:
                    key = stat_names.get(stat.metadata_id)
                    if stat.ref_value:
                        stats[key] = stat_names.get(stat.ref_value)
                    else:
                        stats[key] = stat.str_value or stat.uint64_value or stat.int64_value
                if "tensor_shape" in stats:
                    stats["shape"] = stats["tensor_shape"]
                yield line.timestamp_ns * 1000 + event.offset_ps, name, stats
