"""`python -m jdp.launch`: the command is `jdp.cli.launch`."""

if __name__ == "__main__":
    from jdp.cli.launch import main

    raise SystemExit(main())
