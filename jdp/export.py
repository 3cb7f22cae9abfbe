"""`python -m jdp.export --workdir W --out params.npz`: `jdp.cli.export` (in Python: `jdp.export_params`)."""

if __name__ == "__main__":
    from jdp.cli.export import main
    from jdp.metrics import console_may_close

    with console_may_close(quiet=True):  # `| head` ends it as any command's, without a BrokenPipeError traceback
        raise SystemExit(main())
