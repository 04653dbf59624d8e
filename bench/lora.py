"""LoRA fine-tuning speed and memory: meshtx `Trainer(lora=8)` against HF + peft (rank 8 on the same six matrices)."""
import sys
import train

if __name__ == "__main__":
    train.__doc__ = __doc__
    train.main(sys.argv[1:], lora=8)
