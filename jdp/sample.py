"""`python -m jdp.sample`: the command is `jdp.cli.sample`."""

if __name__ == "__main__":
    from jdp.cli.sample import main
    from jdp.metrics import console_may_close

    with console_may_close(quiet=True):  # `| head` ends it as any command's, without a BrokenPipeError traceback
        raise SystemExit(main())
