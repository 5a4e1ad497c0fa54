"""Reference solution of exercises/09_strip_prefix.py."""


def strip_prefix(state_dict: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in state_dict.items()}
