#!/bin/bash
# The grader runs as root from /tests (copied in after the agent finished); code the agent
# wrote runs only in subprocesses as the agent's user, so it cannot touch the verdict.
if python3 -I -S /tests/grade.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
