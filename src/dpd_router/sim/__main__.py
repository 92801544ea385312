"""`python -m dpd_router.sim --role prefill --port 8100`: run one simulated engine."""

from dpd_router.sim.engine import main

if __name__ == "__main__":
    main()
