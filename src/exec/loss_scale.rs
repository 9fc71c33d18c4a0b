//! Dynamic loss scaling for fp16 runs ([`LossScaler`]); its state is saved in checkpoints
//! (`ckpt::LossScaleState`) so that a resumed run continues with the same scale.

use crate::ckpt::LossScaleState;

/// Dynamic loss scaling for fp16 (as `torch.cuda.amp.GradScaler`): start at 2^16, halve and
/// skip the update when the gradients overflow, double after 2000 clean steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    pub state: LossScaleState,
}

impl LossScaler {
    pub const INITIAL: f32 = 65536.0;
    pub const GROWTH_INTERVAL: u64 = 2000;

    pub fn new() -> LossScaler {
        LossScaler {
            state: LossScaleState {
                scale: Self::INITIAL,
                clean_steps: 0,
            },
        }
    }

    /// Updates the scale after a step that did (`skipped`) or did not overflow.
    pub fn update(&mut self, skipped: bool) {
        let s = &mut self.state;
        if skipped {
            s.scale = (s.scale * 0.5).max(f32::MIN_POSITIVE);
            s.clean_steps = 0;
        } else {
            s.clean_steps += 1;
            if s.clean_steps >= Self::GROWTH_INTERVAL {
                s.scale = (s.scale * 2.0).min(f32::MAX / 2.0);
                s.clean_steps = 0;
            }
        }
    }
}

impl Default for LossScaler {
    fn default() -> LossScaler {
        LossScaler::new()
    }
}

#[cfg(test)]
mod tests {
    use super::LossScaler;

    #[test]
    fn loss_scale_halves_on_overflow_and_doubles_after_clean_steps() {
        let mut s = LossScaler::new();
        assert_eq!(s.state.scale, 65536.0);
        s.update(true);
        assert_eq!((s.state.scale, s.state.clean_steps), (32768.0, 0));
        for _ in 0..LossScaler::GROWTH_INTERVAL - 1 {
            s.update(false);
        }
        assert_eq!(s.state.scale, 32768.0);
        s.update(false);
        assert_eq!((s.state.scale, s.state.clean_steps), (65536.0, 0));
        // An overflow resets the count of clean steps.
        for _ in 0..10 {
            s.update(false);
        }
        s.update(true);
        assert_eq!((s.state.scale, s.state.clean_steps), (32768.0, 0));
    }
}
