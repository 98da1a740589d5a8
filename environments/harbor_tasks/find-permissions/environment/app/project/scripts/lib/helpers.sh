#!/bin/sh
echo helpers
