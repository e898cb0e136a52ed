-- wrk script: a realistic small chat completion request.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-tollgate-consumer"] = "bench"
wrk.body = '{"model":"chat","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Summarise the plot of Hamlet in two sentences."}],"max_tokens":256}'

-- Print p50/p99 in microseconds on a line the runner parses.
done = function(summary, latency, requests)
  io.write(string.format("RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d errors=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status + summary.errors.timeout))
end
