"""A hang's cause from where the culprit's Python is: reading data or a checkpoint while its peers wait
in a collective is data/storage; anything else leaves the cause as the traces decided it."""

from __future__ import annotations

from rankwatch.model.finding import Cause, Finding
from rankwatch.operator.diagnosis.diagnose.python_frames import with_python_stacks

PEER = ["/opt/torch/distributed/distributed_c10d.py:2501 all_reduce", "/src/train.py:40 train_step"]


def hang() -> Finding:
    return Finding("hang", [3], ["gpu-node-1"], None, 0.9, "rank 3 never called AllReduce 12")


def test_a_culprit_in_the_dataloader_while_its_peers_wait_in_nccl_is_data_storage():
    culprit = [
        "/usr/lib/python3.11/multiprocessing/queues.py:113 get",
        "/opt/torch/utils/data/dataloader.py:1133 _get_data",
        "/src/train.py:35 train_step",
    ]
    shown = with_python_stacks(hang(), {3: culprit, 0: PEER, 1: PEER, 2: PEER})
    assert shown.cause is Cause.DATA_STORAGE, shown.cause_evidence
    assert "dataloader.py:1133 _get_data" in shown.cause_evidence and "3 peer(s)" in shown.cause_evidence


def test_a_culprit_saving_a_checkpoint_is_data_storage():
    culprit = ["/opt/torch/serialization.py:652 _save", "/src/megatron/training/checkpointing.py:400 save_checkpoint"]
    assert with_python_stacks(hang(), {3: culprit, 0: PEER}).cause is Cause.DATA_STORAGE


def test_activation_recomputation_training_code_or_everyone_reading_is_not_data_storage():
    recompute = ["/opt/torch/utils/checkpoint.py:300 forward", "/src/model.py:80 forward"]
    assert with_python_stacks(hang(), {3: recompute, 0: PEER}).cause is Cause.UNKNOWN
    deep = ["/src/model.py:10 matmul", "/src/model.py:20 mlp", "/src/model.py:30 layer", "/src/model.py:40 block",
            "/src/train.py:35 get_batch"]  # fmt: skip
    assert with_python_stacks(hang(), {3: deep, 0: PEER}).cause is Cause.UNKNOWN, "below the frames looked at"
    reading = ["/src/data/loader.py:88 __next__"]
    assert with_python_stacks(hang(), {3: reading, 0: reading}).cause is Cause.UNKNOWN, "its peers read too"
    assert with_python_stacks(hang(), {3: reading}).cause is Cause.UNKNOWN, "no peer to compare with"
