"""On-policy distillation from a served teacher (docs/distillation.md): the teacher client and the
trainer with verl's schedulers."""

from __future__ import annotations

import os

from hybridflow.trainer.distill.teacher import TeacherClient, TeacherError, TeacherSettings
from hybridflow.trainer.distill.trainer import SCHEDULERS, OnPolicyDistillTrainer

__all__ = [
    "SCHEDULERS",
    "OnPolicyDistillTrainer",
    "TeacherClient",
    "TeacherError",
    "TeacherSettings",
    "connect_teacher",
]


def connect_teacher(config, tokenizer) -> TeacherClient:
    """A client for ``actor_rollout_ref.teacher``, checked against the student's vocabulary (raises
    :class:`TeacherError` naming the replica when it differs, or the client's error when none answers)."""
    import transformers

    from hybridflow.utils.vocab_fingerprint import vocab_fingerprint

    model = config.actor_rollout_ref.model
    student = transformers.AutoConfig.from_pretrained(
        os.path.expanduser(str(model.path)), trust_remote_code=bool(model.get("trust_remote_code", False))
    )
    client = TeacherClient(TeacherSettings.from_config(config.actor_rollout_ref.teacher))
    try:
        client.check_vocab(int(student.vocab_size), vocab_fingerprint(tokenizer))
    except BaseException:
        client.close()
        raise
    return client
