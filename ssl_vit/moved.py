"""An option that moved (a class's `MOVED_OPTIONS`: old name -> new dotted name) put at its new place in
the options a class is given: a run's own config.yaml (`ssl_vit.cli.moved_options`) and a checkpoint's
hyperparameters (`ssl_vit.tasks.base.upgraded_hparams`) both written before it moved."""

from __future__ import annotations

from ssl_vit.errors import UserError, shown


def move(init_args: dict, old: str, new: str, where: str) -> None:
    """`init_args[old]` moved to the dotted place `new`. Options (of `where`) that give both, with
    different values, are refused in one line: either value would be a guess."""
    *groups, name = new.split(".")
    place = init_args
    for group in groups:
        parent, place = place, place.get(group)
        if place is None:  # absent, or `augment: null` beside the old keys: the group from them alone
            place = parent[group] = {}
        if not isinstance(place, dict):
            raise UserError(f"{where}: {group} is {shown(place)}, beside {old}: give {group} as a mapping")
    value = init_args.pop(old)
    if name in place and place[name] != value:
        raise UserError(
            f"{where}: {old} ({shown(value)}) and {new} ({shown(place[name])}) are both given: keep {new} "
            f"and take {old} out"
        )
    place[name] = value
