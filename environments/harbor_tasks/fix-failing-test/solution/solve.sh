#!/bin/bash
set -e
sed -i 's|return sum(xs) / (len(xs) - 1)|return sum(xs) / len(xs)|' /app/stats.py
cd /app && python3 -m unittest test_stats
