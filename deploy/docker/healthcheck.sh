#!/bin/bash
# The image's HEALTHCHECK: GET /healthz on the metrics port, 200 or fail, with bash's /dev/tcp
# (the image has no curl; bash is in debian:12-slim).
# Usage: zcrelay-healthcheck [PORT]   (default 9100)
port=${1:-9100}
exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 1
printf 'GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
# "HTTP/1.1 200 OK"
read -r -t 2 _ code _ <&3 || exit 1
[[ $code == 200 ]]
