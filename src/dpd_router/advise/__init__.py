"""`dpd-router advise`: tune the routing threshold and the pool ratio from the router's own metrics."""
