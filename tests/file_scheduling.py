"""`--dist loadfile` that survives a crashed worker.

pytest-xdist 3.8.0's file scheduler can deadlock once it replaces a crashed worker (pytest-xdist issues 1323, 1327
and 1378): it puts the dead worker's finished files back on the queue as empty work that never completes, hands
the crashed test to the replacement to crash again, and may leave a new worker holding a single test it cannot
start (a worker runs a test only once it knows the next one), or hand work to a replacement before it has
reported what it collected. Here the crashed test is reported failed once and not restarted, only the dead
worker's unfinished files go back on the queue, and a worker is topped up until it holds enough tests to keep
going, or told no more are coming."""

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

LOW_WATER = 2  # a worker holding this many tests or fewer gets another file (xdist's own threshold)


class CrashSafeFileScheduling(LoadFileScheduling):
    def remove_node(self, node: WorkerController) -> str | None:
        """Forgets a finished or crashed worker; for a crashed one, returns the test it died in."""
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        crashed = next(nodeid for unit in unfinished.values() for nodeid, done in unit.items() if not done)
        unfinished[self._split_scope(crashed)][crashed] = True
        self.workqueue.update({scope: unit for scope, unit in unfinished.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node: WorkerController) -> None:
        """Tops `node` up, or tells it no more work is coming. A replacement worker that has not reported its
        collection yet is left for the report: two crashes replace two workers, and the first replacement's report
        reschedules every node, the second's too."""
        if node.shutting_down or node not in self.registered_collections:
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= LOW_WATER:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()
