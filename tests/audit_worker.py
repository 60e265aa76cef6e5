"""Run by ``torchrun`` from tests/test_audit_doors.py (not a test module itself).

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/audit_worker.py OUT``:
a make_private run with white-box canaries over the gloo processes, in each distributed mode;
each rank writes its canary scores to OUT.
"""

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(out):
    import torch.distributed as dist
    from audit_door_helpers import SIGMA, audited, train

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode in ("sharded", "rank0", "replicated"):
        audit = audited(
            5,
            target_epsilon=None,
            noise_multiplier=SIGMA,
            process_group=dist.group.WORLD,
            distributed_mode=mode,
        )
        np.save(os.path.join(out, f"{mode}.rank{rank}.npy"), train(audit).scores())
    dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
    # every result is written and the process group destroyed: leave without the interpreter's
    # teardown, where gloo's background threads can abort the process (std::terminate, exit -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
