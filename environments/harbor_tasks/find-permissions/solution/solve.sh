#!/bin/bash
set -e
cd /app/project
find . -type f -name '*.sh' -exec chmod u+x {} +
find . -type f -name '*.tmp' -delete
find . -type f | sort
