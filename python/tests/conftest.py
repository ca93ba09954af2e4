import sys
from pathlib import Path

# toy.py beside the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))
