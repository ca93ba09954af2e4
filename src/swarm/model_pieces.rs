//! Where the built-in trainer's model stages run: on the CPU ([`Stage`]) or
//! on a device ([`DeviceStage`] on a [`Backend`]: CUDA for
//! `gwtf node --device cuda`, the host backend in the tests).
//!
//! The trainer drives a [`Piece`] with host values, because frames are host
//! memory: a device piece uploads a microbatch's input and downloads its
//! output, and after each backward downloads the microbatch's parameter
//! gradient, which the trainer keeps apart until its stage aggregates
//! (exactly once: see [`super::model_trainer`]). Parameters, moments and
//! activations stay on the device.
use crate::model::gpu::{Backend, DeviceIds, DeviceInput, DeviceOutput, DeviceStage};
use crate::model::stage::MicrobatchId;
use crate::model::{
    AdamW, ModelConfig, ModelError, Stage, StageInput, StageOutput, StagePlan, StageSpec,
    StageState, StateParts,
};
use std::sync::Arc;

/// One model stage as the swarm's trainer drives it. The meaning of each
/// method is [`Stage`]'s method of the same name.
pub trait Piece: Send {
    fn spec(&self) -> &StageSpec;
    fn num_params(&self) -> usize;
    fn forward(
        &mut self,
        mb: MicrobatchId,
        batch: usize,
        seq: usize,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, ModelError>;
    fn backward(
        &mut self,
        mb: MicrobatchId,
        grad_output: Option<&[f32]>,
    ) -> Result<Option<Vec<f32>>, ModelError>;
    fn discard(&mut self, mb: MicrobatchId) -> bool;
    fn take_grads(&mut self) -> Result<Vec<f32>, ModelError>;
    fn set_mean_grads(&mut self, mean: &[f32]) -> Result<(), ModelError>;
    fn step(&mut self, opt: &AdamW) -> Result<(), ModelError>;
    /// A copy of the parameters on the host.
    fn params(&self) -> Result<Vec<f32>, ModelError>;
    fn swap_params(&mut self, other: &mut Vec<f32>) -> Result<(), ModelError>;
    /// [`Stage::set_moments`]: the optimizer state only.
    fn set_moments(&mut self, step: u64, m: &[f32], v: &[f32]) -> Result<(), ModelError>;
    fn state(&self) -> Result<StageState, ModelError>;
    fn set_state(&mut self, st: &StageState) -> Result<(), ModelError>;
    /// [`Stage::state_bytes_into`]: the exported state's bytes, piece by piece.
    fn state_bytes_into(&self, sink: &mut dyn FnMut(&[u8])) -> Result<(), ModelError>;
    /// [`Stage::import_state`], checked before any change.
    fn import_state(&mut self, b: &[u8]) -> Result<(), ModelError> {
        let spec = self.spec().index;
        let parts = StateParts::parse(b, spec, self.num_params())?;
        self.set_state(&StageState::from_parts(&parts)?)
    }
}

/// Builds the pieces a node serves, where they run.
pub trait Placement: Send + Sync {
    /// Stage `index` of `plan` of `cfg`, initialised from `seed` (the same
    /// weights wherever it runs).
    fn build(
        &self,
        cfg: &ModelConfig,
        plan: &StagePlan,
        index: usize,
        seed: u64,
    ) -> Result<Box<dyn Piece>, ModelError>;
    /// Where, in words (`cpu`, the device's name).
    fn describe(&self) -> String;
}

/// The CPU: [`Stage`].
#[derive(Clone, Copy, Debug, Default)]
pub struct OnCpu;

impl Placement for OnCpu {
    fn build(
        &self,
        cfg: &ModelConfig,
        plan: &StagePlan,
        index: usize,
        seed: u64,
    ) -> Result<Box<dyn Piece>, ModelError> {
        Ok(Box::new(Stage::new(cfg, plan, index, seed)?))
    }
    fn describe(&self) -> String {
        "cpu".into()
    }
}

/// A [`Backend`]: [`DeviceStage`].
pub struct OnBackend<B>(pub Arc<B>);

impl<B> Placement for OnBackend<B>
where
    B: Backend + Send + Sync + 'static,
    B::Buf: Send,
    B::Ids: Send + Sync,
{
    fn build(
        &self,
        cfg: &ModelConfig,
        plan: &StagePlan,
        index: usize,
        seed: u64,
    ) -> Result<Box<dyn Piece>, ModelError> {
        Ok(Box::new(DeviceStage::new(
            self.0.clone(),
            cfg,
            plan,
            index,
            seed,
        )?))
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

impl Piece for Stage {
    fn spec(&self) -> &StageSpec {
        Stage::spec(self)
    }
    fn num_params(&self) -> usize {
        Stage::num_params(self)
    }
    fn forward(
        &mut self,
        mb: MicrobatchId,
        batch: usize,
        seq: usize,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, ModelError> {
        Stage::forward(self, mb, batch, seq, input, targets)
    }
    fn backward(
        &mut self,
        mb: MicrobatchId,
        grad_output: Option<&[f32]>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        Stage::backward(self, mb, grad_output)
    }
    fn discard(&mut self, mb: MicrobatchId) -> bool {
        Stage::discard(self, mb)
    }
    fn take_grads(&mut self) -> Result<Vec<f32>, ModelError> {
        Ok(Stage::take_grads(self))
    }
    fn set_mean_grads(&mut self, mean: &[f32]) -> Result<(), ModelError> {
        Stage::set_mean_grads(self, mean)
    }
    fn step(&mut self, opt: &AdamW) -> Result<(), ModelError> {
        Stage::step(self, opt)
    }
    fn params(&self) -> Result<Vec<f32>, ModelError> {
        Ok(Stage::params(self).to_vec())
    }
    fn swap_params(&mut self, other: &mut Vec<f32>) -> Result<(), ModelError> {
        Stage::swap_params(self, other)
    }
    fn set_moments(&mut self, step: u64, m: &[f32], v: &[f32]) -> Result<(), ModelError> {
        Stage::set_moments(self, step, m, v)
    }
    fn state(&self) -> Result<StageState, ModelError> {
        Ok(Stage::state(self))
    }
    fn set_state(&mut self, st: &StageState) -> Result<(), ModelError> {
        Stage::set_state(self, st)
    }
    fn state_bytes_into(&self, sink: &mut dyn FnMut(&[u8])) -> Result<(), ModelError> {
        Stage::state_bytes_into(self, sink);
        Ok(())
    }
    fn import_state(&mut self, b: &[u8]) -> Result<(), ModelError> {
        Stage::import_state(self, b)
    }
}

impl<B> Piece for DeviceStage<B>
where
    B: Backend + Send + Sync,
    B::Buf: Send,
    B::Ids: Send + Sync,
{
    fn spec(&self) -> &StageSpec {
        DeviceStage::spec(self)
    }
    fn num_params(&self) -> usize {
        DeviceStage::num_params(self)
    }
    fn forward(
        &mut self,
        mb: MicrobatchId,
        batch: usize,
        seq: usize,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, ModelError> {
        let be = self.backend().clone();
        let vocab = self.config().vocab_size;
        let input = match input {
            StageInput::Tokens(x) => DeviceInput::Tokens(DeviceIds::upload(&*be, x, vocab)?),
            StageInput::Hidden(h) => DeviceInput::Hidden(be.upload(h)?),
        };
        let targets = targets
            .map(|y| DeviceIds::upload(&*be, y, vocab))
            .transpose()?;
        Ok(
            match DeviceStage::forward(self, mb, batch, seq, input, targets)? {
                DeviceOutput::Hidden(h) => StageOutput::Hidden(be.download_buf(&h)?),
                // Each position's loss, averaged in f64 as the CPU's
                // cross-entropy does.
                DeviceOutput::Loss(rows) => {
                    let rows = be.download_buf(&rows)?;
                    let sum: f64 = rows.iter().map(|&x| x as f64).sum();
                    StageOutput::Loss((sum / rows.len().max(1) as f64) as f32)
                }
            },
        )
    }
    fn backward(
        &mut self,
        mb: MicrobatchId,
        grad_output: Option<&[f32]>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let be = self.backend().clone();
        let g = grad_output.map(|g| be.upload(g)).transpose()?;
        DeviceStage::backward(self, mb, g)?
            .map(|dx| be.download_buf(&dx))
            .transpose()
    }
    fn discard(&mut self, mb: MicrobatchId) -> bool {
        DeviceStage::discard(self, mb)
    }
    fn take_grads(&mut self) -> Result<Vec<f32>, ModelError> {
        DeviceStage::take_grads(self)
    }
    fn set_mean_grads(&mut self, mean: &[f32]) -> Result<(), ModelError> {
        DeviceStage::set_mean_grads(self, mean)
    }
    fn step(&mut self, opt: &AdamW) -> Result<(), ModelError> {
        DeviceStage::step(self, opt)
    }
    fn params(&self) -> Result<Vec<f32>, ModelError> {
        self.params_to_host()
    }
    fn swap_params(&mut self, other: &mut Vec<f32>) -> Result<(), ModelError> {
        DeviceStage::swap_params(self, other)
    }
    fn set_moments(&mut self, step: u64, m: &[f32], v: &[f32]) -> Result<(), ModelError> {
        DeviceStage::set_moments(self, step, m, v)
    }
    fn state(&self) -> Result<StageState, ModelError> {
        DeviceStage::state(self)
    }
    fn set_state(&mut self, st: &StageState) -> Result<(), ModelError> {
        DeviceStage::set_state(self, st)
    }
    fn state_bytes_into(&self, sink: &mut dyn FnMut(&[u8])) -> Result<(), ModelError> {
        DeviceStage::state(self)?.bytes_into(sink);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gpu::HostBackend;
    use crate::model::preset;

    /// Stage 1 of llama-tiny cut into 3, on the CPU and on the host backend.
    fn both() -> (Box<dyn Piece>, Box<dyn Piece>) {
        let cfg = preset("llama-tiny").unwrap();
        let plan = StagePlan::new(&cfg, 3).unwrap();
        let on_device = OnBackend(Arc::new(HostBackend));
        (
            OnCpu.build(&cfg, &plan, 1, 5).unwrap(),
            on_device.build(&cfg, &plan, 1, 5).unwrap(),
        )
    }

    fn state_bytes(p: &dyn Piece) -> Vec<u8> {
        let mut b = Vec::new();
        p.state_bytes_into(&mut |x| b.extend_from_slice(x)).unwrap();
        b
    }

    /// What the trainer does with a piece (forward, backward, a gradient
    /// taken out, a mean applied, weights swapped, a state imported) gives
    /// the same values, bit for bit, on the host backend as on the CPU.
    #[test]
    fn a_device_piece_does_what_the_cpu_piece_does() {
        let (mut cpu, mut dev) = both();
        assert_eq!(state_bytes(&*cpu), state_bytes(&*dev));
        let (b, t) = (2, 8);
        let d = preset("llama-tiny").unwrap().d_model;
        let h: Vec<f32> = (0..b * t * d)
            .map(|i| ((i % 13) as f32 - 6.0) * 0.05)
            .collect();
        let g: Vec<f32> = (0..b * t * d)
            .map(|i| ((i % 7) as f32 - 3.0) * 0.01)
            .collect();
        for p in [&mut cpu, &mut dev] {
            p.forward(1, b, t, StageInput::Hidden(&h), None).unwrap();
        }
        let (StageOutput::Hidden(yc), StageOutput::Hidden(yd)) = (
            cpu.forward(2, b, t, StageInput::Hidden(&g), None).unwrap(),
            dev.forward(2, b, t, StageInput::Hidden(&g), None).unwrap(),
        ) else {
            panic!("a relay stage gives activations");
        };
        assert_eq!(yc, yd);
        assert!(cpu.discard(2) && dev.discard(2));
        let dxc = cpu.backward(1, Some(&g)).unwrap();
        let dxd = dev.backward(1, Some(&g)).unwrap();
        assert_eq!(dxc, dxd);
        let gc = cpu.take_grads().unwrap();
        assert_eq!(gc, dev.take_grads().unwrap());
        assert!(gc.iter().any(|&x| x != 0.0));
        // Taken out: the accumulator is empty again.
        assert_eq!(dev.take_grads().unwrap(), vec![0.0; gc.len()]);
        let opt = AdamW::default();
        for p in [&mut cpu, &mut dev] {
            assert!(matches!(p.step(&opt), Err(ModelError::NothingAccumulated)));
            p.set_mean_grads(&gc).unwrap();
            p.step(&opt).unwrap();
        }
        assert_eq!(state_bytes(&*cpu), state_bytes(&*dev));
        // Swapped weights: the device returns its own and takes the others.
        let before = cpu.params().unwrap();
        let mut other = vec![0.5f32; before.len()];
        dev.swap_params(&mut other).unwrap();
        assert_eq!(
            (other, dev.params().unwrap()),
            (before.clone(), vec![0.5; before.len()])
        );
        let mut back = before.clone();
        dev.swap_params(&mut back).unwrap();
        assert_eq!(state_bytes(&*cpu), state_bytes(&*dev));
        // A state moves between them.
        let (_, mut fresh) = both();
        fresh.import_state(&state_bytes(&*cpu)).unwrap();
        assert_eq!(state_bytes(&*fresh), state_bytes(&*cpu));
    }

    /// Values of the wrong size are refused and change nothing.
    #[test]
    fn a_device_piece_refuses_wrong_sizes_and_keeps_its_state() {
        let (_, mut dev) = both();
        let was = state_bytes(&*dev);
        let n = dev.num_params();
        assert!(dev.set_mean_grads(&vec![0.0; n - 1]).is_err());
        assert!(dev.swap_params(&mut vec![0.0; n + 1]).is_err());
        assert!(dev.import_state(&was[..was.len() - 4]).is_err());
        let h = vec![0.0f32; 7];
        assert!(dev.forward(1, 2, 8, StageInput::Hidden(&h), None).is_err());
        assert!(dev.backward(9, Some(&h)).is_err());
        assert_eq!(state_bytes(&*dev), was);
    }
}
