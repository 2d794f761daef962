-- tls_wrk.lua: wrk script for bench/run's sni workload.
--
--   WRK_CONNECT_PORT=P WRK_MAX_REQUESTS=N wrk -t1 -cC -dDs -s tls_wrk.lua \
--       -H 'Connection: close' https://api.example.test:P/tiny
--
-- wrk sends the URL's host as the TLS server name (SSL_set_tlsext_host_name) and in Host, and
-- would resolve it; this script connects to 127.0.0.1:WRK_CONNECT_PORT instead, so no name
-- needs to resolve (nothing in /etc/hosts) and all traffic stays on loopback.
-- With `Connection: close` the server closes after each response and wrk opens a new
-- connection, with a new TLS handshake, for the next request.
--
-- Bounded in count as well as in time (-d): after WRK_MAX_REQUESTS requests (default 1e6) the
-- thread stops; it then prints "limit":1, and bench/run fails the run (a rate over wrk's full
-- -d would be wrong). done() prints one JSON line with wrk's own totals.
local port = os.getenv("WRK_CONNECT_PORT")
local max_requests = tonumber(os.getenv("WRK_MAX_REQUESTS") or "1000000")
local threads = {}   -- main state: the threads, to read their `limited` in done()
local sent = 0       -- thread state, as everything below but setup() and done()
local req = nil
limited = 0          -- global: thread:get() reads globals only

function wrk.resolve(host, service)
   wrk.addrs = wrk.lookup("127.0.0.1", port or service)
end

function setup(thread)
   table.insert(threads, thread)
end

function init(args)
   req = wrk.format()
end

function request()
   sent = sent + 1
   if sent > max_requests then
      limited = 1
      wrk.thread:stop()
   end
   return req
end

function done(summary, latency, requests)
   local e = summary.errors
   local lim = 0
   for _, t in ipairs(threads) do
      if t:get("limited") == 1 then lim = 1 end
   end
   io.write(string.format(
      '{"requests":%d,"bytes":%d,"duration_us":%d,"connect_errors":%d,"read_errors":%d,' ..
      '"write_errors":%d,"status_errors":%d,"timeouts":%d,"p50_us":%d,"p99_us":%d,"limit":%d}\n',
      summary.requests, summary.bytes, summary.duration, e.connect, e.read, e.write, e.status,
      e.timeout, latency:percentile(50), latency:percentile(99), lim))
end
