#!/bin/bash
set -e
cat > /app/summarize.py <<'EOF'
import csv
import json
import sys

totals = {}
with open(sys.argv[1], newline="") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] = totals.get(row["region"], 0.0) + float(row["amount"])
print(json.dumps({region: round(total, 2) for region, total in sorted(totals.items())}))
EOF
python3 /app/summarize.py /app/sales.csv
