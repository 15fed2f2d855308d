"""wheeld's options take their defaults from Config, where each is written once."""

from __future__ import annotations

import dataclasses

from wheeld.daemon import cli
from wheeld.daemon.config import Config


def test_every_option_named_after_a_config_field_defaults_to_that_field():
    fields = {f.name: f for f in dataclasses.fields(Config)}
    checked = []
    for param in cli.main.params:
        field = fields.get(param.name)
        if field is None or field.default is dataclasses.MISSING or param.default is None or param.multiple:
            continue  # a default computed at run time (socket path, name), or a list option (--group-owner)
        assert param.default == field.default, (param.name, param.default, field.default)
        checked.append(param.name)
    # the options whose defaults used to be written twice (here and in Config) are all covered
    assert {"tick_ms", "wheel_size", "capacity", "ring_capacity", "touch_capacity", "fsync", "journal_damage",
            "group_quota", "max_groups", "max_clients", "resume_grace_s", "ack_timeout_s", "frame_timeout_s",
            "coalesce_us"} <= set(checked), checked
