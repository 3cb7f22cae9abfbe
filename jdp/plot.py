"""`python -m jdp.plot`: the command is `jdp.cli.plot`."""

if __name__ == "__main__":
    from jdp.cli.plot import main

    raise SystemExit(main())
