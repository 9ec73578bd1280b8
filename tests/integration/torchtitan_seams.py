"""The environment variables through which the torchtitan failure tests steer their groups' processes.

Read by :mod:`tests.integration.torchtitan_job` (which documents them) and
set by ``test_torchtitan_stalwart``; kept apart from the job so that
collecting the tests does not import torchtitan into every pytest process
(1.5 s of CPU each: the processes that train it are forked from a server
that imported it once).
"""

RUN_DIR_VARIABLE = "STALWART_TEST_RUN_DIR"
HOLD_VARIABLE = "STALWART_TEST_HOLD_FILE"
GO_VARIABLE = "STALWART_TEST_GO_FILE"
