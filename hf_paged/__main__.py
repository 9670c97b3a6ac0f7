"""``python -m hf_paged``: the ``hf-paged`` command line."""

from hf_paged.cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m hf_paged"))
