"""missing_rank: the last rank returns before init_process_group; the others wait in it."""

import sys

import _scenario as sc

sc.self_destruct()
if sc.RANK == sc.WORLD_SIZE - 1:
    sys.exit(0)  # exit code 0: torchrun keeps waiting for the others instead of tearing down
sc.ready_when_in("init_process_group")
sc.init_gloo()
