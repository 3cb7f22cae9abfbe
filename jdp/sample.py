"""`python -m jdp.sample`: the command is `jdp.cli.sample`."""

if __name__ == "__main__":
    from jdp.cli.sample import main

    raise SystemExit(main())
