"""The engines the router sends work to: endpoints, pools and their health."""
