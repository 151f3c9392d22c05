"""Read-only views of the state the Pacer's owners hold (its step boundary, lifecycle, checkpoints, journal)."""
from __future__ import annotations


class PacerViews:
    """The Pacer's properties that read its owners' state; that state changes only through the owners' methods."""

    step = property(lambda self: self.steps.step, doc="The trainer's step (Resume adds one).")
    weight_version = property(lambda self: self.steps.weight_version, doc="The weight version of the last Resume.")
    generation = property(lambda self: self.steps.generation, doc="Reset and Restore count generations.")
    paused = property(lambda self: self.steps.paused, doc="Dispatch is paused (Reset, EndJob).")
    resetting = property(lambda self: self.steps.resetting, doc="A Reset is between its begin and finish.")
    closed = property(lambda self: self.lifecycle.closed, doc="Shutting down: no new calls are taken.")
    job_ended = property(lambda self: self.lifecycle.job_ended, doc="EndJob closed dispatch for good (journaled).")
    job_end_mode = property(lambda self: self.lifecycle.job_end_mode, doc="The mode EndJob ended the job with.")
    last_checkpoint = property(lambda self: self.checkpoints.last_checkpoint,
                               doc="(step, weight version, wall time) of the last checkpoint taken; None: none yet.")
    last_restore = property(lambda self: self.checkpoints.last_restore,
                            doc="(step, weight version, wall time) of the last checkpoint restored; None: none yet.")
    journal = property(lambda self: self.recorder.journal, doc="Where changes are recorded (None: memory only).")
    clock = property(lambda self: self._clock, doc="The pacer's clock (pinned to each event's time in replay).")
    strategy = property(lambda self: self._strategy,
                        doc="The pacing strategy as configured (a `ThreadSafeStrategy` proxy unless one was passed in).")
    last_ticket = property(lambda self: self.recorder.last_ticket,
                           doc="The journal ticket of the latest recorded change (what a caller waits on to be durable).")
    liveness_seconds = property(lambda self: self.liveness.grace, doc="server.worker_liveness_seconds.")
    trainer_liveness_seconds = property(lambda self: self.liveness.trainer_grace,
                                        doc="server.trainer_liveness_seconds (the workers' when null).")
    worker_contact = property(lambda self: self.workers.contact,
                              doc="contact(client_ids): seconds since each was last heard, its open watch streams.")
