"""`python -m conveyor.gateway` runs the gateway."""

from conveyor.gateway.server import main

if __name__ == "__main__":
    main()
