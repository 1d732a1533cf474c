"""The durable scheduling repository: every task transition as one fenced
PostgreSQL transaction (compare-and-set), the time taken from an injected clock.

CONTRACT (signatures fixed). Every method is one transaction that commits the
whole transition or changes nothing (the host transitions built by ``claim_op``,
``ack_op``, ``progress_op`` and ``report_result_op`` may share one transaction
through ``run_many``, group commit: each still takes effect whole or not at
all, and a refused one never undoes another); errors are the typed ones of
``persistence.errors``. Host-facing methods take the caller's ``Session`` (host
id + generation), already authenticated by the transport; they re-check in the
same transaction that the generation is the host's current one and the host is
not revoked (else ``Unauthorized``).

Decisions worth knowing when coding against this package:

* Deadlines: an attempt in ``assigned`` expires at ``claim_deadline``; in
  ``dispatched`` at ``ack_deadline`` (``lease_expires_at`` is set equal to it at
  claim, and a renewal in ``dispatched`` is accepted, reports the cancel flag, but
  never extends past the ack deadline); in ``running`` at ``lease_expires_at``
  (``now + lease_s`` from ack, renew, progress and a confirming reconciliation).
  A message exactly at the deadline loses (``deadline > now`` is required).
* Fencing order for host messages: session current and host not revoked
  (``Unauthorized``), task exists (``NotFound``), the referenced attempt exists
  (else ``Conflict`` reason ``unknown_attempt``), the lease token matches
  (``Conflict`` ``wrong_lease``; claim has no token yet), the attempt belongs to
  the caller's host (``Forbidden``), it is the current attempt (``Conflict``
  ``stale_attempt``), it is bound to the caller's session generation (``Conflict``
  ``session_not_bound``: after a new registration ``reconcile`` rebinds it), the
  task is not terminal (``Gone``), the state accepts the message (``Conflict``
  ``wrong_state``), the deadline has not passed (``Gone`` for claim and ack;
  ``Conflict`` ``lease_expired`` for renew, progress and result). Every error
  carries ``reason`` in ``fields``. A result replay (same attempt and fingerprint
  as the recorded one) needs a current session, the host and the token only.
* A zero backoff base sends an expired or retryably failed task straight back to
  ``queued``; otherwise ``retrying`` until ``eligible_at``. A pending cancel turns
  any expiry, loss or retryable failure into ``cancelled``.
* ``current_generation`` returns None also for a host that never registered.
"""

from __future__ import annotations

from fleetlease.persistence.repository._sql import _is_prebuilt as _is_prebuilt
from fleetlease.persistence.repository._sql import _prebuilt as _prebuilt
from fleetlease.persistence.repository._tx import _sqlstate as _sqlstate
from fleetlease.persistence.repository._validate import MAX_PAYLOAD_BYTES
from fleetlease.persistence.repository._validate import _check_task_id as _check_task_id
from fleetlease.persistence.repository._validate import _check_user as _check_user
from fleetlease.persistence.repository.assign import AssignMixin
from fleetlease.persistence.repository.cancel import CancelMixin
from fleetlease.persistence.repository.drain import DrainMixin
from fleetlease.persistence.repository.leases import Renewal
from fleetlease.persistence.repository.periodic import PeriodicMixin
from fleetlease.persistence.repository.reconcile import ReconcileMixin
from fleetlease.persistence.repository.replay import ReplayMixin
from fleetlease.persistence.repository.results import ResultMixin
from fleetlease.persistence.repository.sidechannels import SideChannelMixin
from fleetlease.persistence.repository.submit import SubmitMixin
from fleetlease.persistence.repository.transitions import Transition
from fleetlease.persistence.repository.views import _iso as _iso

__all__ = ["MAX_PAYLOAD_BYTES", "Renewal", "Repository", "Transition"]
# Also importable from here, for ``persistence.reads``, ``persistence.bulk`` and
# the tests, though not public: ``_check_task_id``, ``_check_user``, ``_iso``,
# ``_is_prebuilt``, ``_prebuilt``, ``_sqlstate``.


class Repository(
    DrainMixin,
    SubmitMixin,
    AssignMixin,
    ResultMixin,
    CancelMixin,
    ReconcileMixin,
    SideChannelMixin,
    ReplayMixin,
    PeriodicMixin,
):
    """The durable scheduling repository (see the package documentation above): one
    class composed of one mixin per role, each in its own module."""
