"""`python -m dpd_sim --role prefill --port 8100`: run one simulated engine."""

from dpd_sim.engine import main

if __name__ == "__main__":
    main()
