"""``python -m zerofast``: the same command as the ``zerofast`` console script."""
try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C before main() can catch it: say what main() says, not a traceback
    import sys

    print("zerofast: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
