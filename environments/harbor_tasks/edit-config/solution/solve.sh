#!/bin/bash
set -e
cd /app
sed -i -e 's/^port = 8000$/port = 8080/' -e 's/^debug = true$/debug = false/' \
    -e 's/^pool_size = 5$/pool_size = 20/' server.ini
cat server.ini
