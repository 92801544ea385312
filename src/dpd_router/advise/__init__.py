"""`dpd-router advise`: tune the routing threshold and the pool ratio from the router's own metrics.

It reads one or more `/metrics` scrapes of dpd-router (live with `--metrics URL`, or saved with
`--file FILE`; several routers are summed, and `--since FILE` / `--window SECONDS` subtract an
earlier scrape so that only the traffic in between counts) and answers the playbook's questions:

1. **Prompt-token distribution** (`dpd_router_prompt_tokens{path}`, all paths summed): count,
   mean (exact, from `_sum`/`_count`) and percentiles estimated from the histogram buckets the way
   Prometheus' `histogram_quantile` does (linear inside a bucket; a percentile in the `+Inf`
   bucket is reported as the highest finite bound, marked `>=`).
2. **Share of traffic above candidate thresholds** (512 ... 32768 tokens by default): requests with
   more than T tokens (exact when T is a bucket bound, interpolated otherwise) and the share of
   prompt tokens they carry (estimated: each bucket's requests at the bucket's midpoint, scaled so
   the total matches the exact `_sum`).
3. **TTFT by prompt length and path** (`dpd_router_time_to_first_token_seconds{path,prompt_tokens}`,
   whose label is the bucket's upper bound in tokens): per bucket and path the request count, the
   mean (exact) and p50/p90 (estimated from the latency buckets).
4. **Recommended threshold**, the crossover where the disaggregated path's TTFT stops losing to the
   direct path's:

   - A prompt-length bucket is *comparable* when both paths have at least `--min-requests`
     requests in it; otherwise it is "not enough evidence" and takes no part in the decision.
   - In a comparable bucket the disaggregated path *does not lose* when its TTFT statistic
     (`--statistic`, the mean by default) is at most the direct path's times `1 + --tolerance`
     (5% by default: a tie goes to disaggregation, which also takes the prefill off the decoders
     and so protects their inter-token latency).
   - The crossover bucket is the lowest comparable bucket from which the disaggregated path does not
     lose in *every* comparable bucket above it. The recommended threshold is that bucket's lower
     edge (the previous bucket's bound): "disaggregated wins above 2k tokens" gives 2048.
   - If the disaggregated path loses in the highest comparable bucket, there is no crossover in the
     evidence: keep those prompts direct, raising the threshold to at least that bucket's bound.
   - Fallback when no bucket is comparable (the usual case with one static threshold, since each
     length then takes one path only): if each path has at least two buckets with enough requests,
     fit TTFT = a + b * tokens per path (weighted by requests, at each bucket's midpoint) and take
     the crossing point, rounded to the nearest bucket bound (log scale), marked "extrapolated".
     A crossing outside the measured lengths, or fewer buckets, gives no recommendation ("not
     enough evidence"), with how to collect it: move the threshold for a while (both paths then
     see the same lengths), or run one router replica with another threshold and advise on both.

5. **Recommended prefill:decode ratio**: the work each pool does, in engine-seconds, from the token
   counters and per-engine capacities (`--prefill-rate`, prompt tokens/s of one prefill engine;
   `--decode-rate`, output tokens/s of one decode engine at your ITL target; the defaults are an
   8B model on one H100, measure yours as deploy/README.md "Sizing the pools" says):

       prefill work = disaggregated prompt tokens / prefill rate
       decode work  = output tokens (all paths) / decode rate + direct prompt tokens / prefill rate

   (decoders prefill the direct path's prompts themselves). The ratio of the two, as small integers
   and split over the engines the router has now, is the recommendation, computed both at the
   current threshold (exact token sums) and at the recommended one (prompt tokens above it
   estimated from the histogram). It is then checked against the pools' scraped load
   (`dpd_router_endpoint_load{signal=waiting|kv_cache_usage}`, a snapshot): when one pool has
   requests waiting (>= 1 per engine, or decoders' KV cache >= 90% full) and the other has none
   (< 0.5 per engine), and the demand ratio would not move an engine towards the queueing pool,
   one engine is moved towards it, and the output says so.

6. **Adaptive threshold** (routers in `threshold_mode: adaptive`): each router's effective threshold
   per decoder at that decoder's load when scraped (`dpd_router_adaptive_threshold_tokens`) and the
   costs it learned (`dpd_router_adaptive_cost`: overhead, time per token and observations per model
   and endpoint; the ITL budget's gaps). The routing decisions table (`route_decisions_total`) gives
   its decisions by reason.

7. **Arms side by side** (arms.py): the request metrics' `arm` label names the experiment arm a
   request took ("live" without one, and in scrapes older than the label; "shadow" for the copies
   sent to a shadow endpoint, path "monolithic" or "dpd"). Per arm, path and prompt-length class
   (`--classes`, cut at 2048 by default), TTFT p50/p95, ITL p99 and E2E p95 from the by-prompt-length
   histograms, each with a bootstrap interval (bootstrap.py: the bucket counts resampled
   multinomially, seeded). Per class and metric the best arm against the runner-up: "winner" when the
   difference's interval is clear of 0, else "undecided" with the traffic that would make it
   significant (the interval shrinks as 1/sqrt(traffic); in hours when the window's length is known:
   `--hours`, `--window`, or the times of the `--since` and later scrapes), or "not enough data"
   (fewer observations than the quantile needs: p95 100, p99 500) with the traffic to get them.
   The shadow's copies are left out of points 1-6 (they repeat live requests on other engines).
8. **Promotion check and go/no-go verdict** (verdict.py, whose docstring has the rules): per
   prompt-length bucket over 2k tokens, disaggregated P95 TTFT <= monolithic P95 TTFT + the measured
   transfer overhead; and DPD is the right tool when more than 15% of requests have prompts over 2k
   tokens and the ITL SLO misses (`--itl-slo`) are attributable to long prompts prefilled on decoders.

The output is plain-text tables with the evidence (or `--json`, whose "arms", "promotion" and
"verdict" hold points 7 and 8), and `--plot FILE` writes a PNG of TTFT per path against prompt length
with the distribution and the threshold marked, and the arms' TTFT p95 and ITL p99 per class side by
side when there are several (matplotlib, the `bench` extra).
"""
