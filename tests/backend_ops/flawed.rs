//! A flawed backend, to show the checks fail: the backend under test
//! ([`memwall::backend::under_test`]: the CPU unless `MEMWALL_TEST_DEVICE` says otherwise)
//! behind a wrapper that changes one thing in each op (or its step context) before running
//! it, as a bug in a new backend would. Everything else goes through to its device unchanged.

use memwall::backend::{Backend, Device, StepCtx, under_test};
use memwall::dist::Comms;
use memwall::dtype::DType;
use memwall::ir::schedule::OpEntry;
use memwall::ir::{BufId, Op, Program, Sizing};

/// What the flawed backend gets wrong.
#[derive(Clone, Copy)]
pub enum Flaw {
    /// Runs each op as this changes it (and its step context).
    Op(fn(&mut Op, &mut StepCtx)),
    /// Zeroes an op's bound gradients before running it (an op meant to add to its
    /// gradients then leaves what one that overwrote them would).
    ZeroGradsFirst,
}

/// The backend under test with `Flaw`.
pub struct Flawed(pub Flaw);

impl Sizing for Flawed {
    fn attention_workspace_elems(
        &self,
        s: DType,
        t: usize,
        hs: usize,
        window: Option<usize>,
        threads: usize,
    ) -> usize {
        under_test().attention_workspace_elems(s, t, hs, window, threads)
    }
    fn mixed_gemm_workspace_elems(&self) -> usize {
        under_test().mixed_gemm_workspace_elems()
    }
    fn quantized_gemm_workspace_elems(&self, cols: usize) -> usize {
        under_test().quantized_gemm_workspace_elems(cols)
    }
    fn library_scratch_bytes(&self, ops: &[OpEntry], storage: DType, threads: usize) -> u64 {
        under_test().library_scratch_bytes(ops, storage, threads)
    }
    fn compute_note(&self, storage: DType) -> Option<String> {
        under_test().compute_note(storage)
    }
    fn tiers(&self) -> &'static [memwall::ir::Tier] {
        under_test().tiers()
    }
    fn baseline_bytes(&self) -> Option<u64> {
        under_test().baseline_bytes()
    }
}

impl Backend for Flawed {
    fn start(&self, program: &Program, comms: Comms) -> anyhow::Result<Box<dyn Device>> {
        Ok(Box::new(FlawedDevice(
            under_test().start(program, comms)?,
            self.0,
        )))
    }

    fn measure_peak(&self) -> Option<memwall::backend::Peak> {
        under_test().measure_peak()
    }

    fn bench_facts(
        &self,
        storage: memwall::dtype::DType,
    ) -> serde_json::Map<String, serde_json::Value> {
        under_test().bench_facts(storage)
    }

    fn processor(&self) -> String {
        under_test().processor()
    }
}

struct FlawedDevice(Box<dyn Device>, Flaw);

impl Device for FlawedDevice {
    fn run(&self, e: &OpEntry, ctx: &StepCtx) -> anyhow::Result<()> {
        let (mut e, mut ctx) = (e.clone(), *ctx);
        match self.1 {
            Flaw::Op(f) => f(&mut e.op, &mut ctx),
            Flaw::ZeroGradsFirst => {
                if let Some(g) = e.grads {
                    let zero = OpEntry {
                        op: Op::Zero { buf: g.buf },
                        params: None,
                        grads: None,
                        ..e.clone()
                    };
                    self.0.run(&zero, &ctx)?;
                }
            }
        }
        self.0.run(&e, &ctx)
    }
    fn sync(&self) -> anyhow::Result<()> {
        self.0.sync()
    }
    fn scope(&self, f: &mut (dyn FnMut() + Send)) {
        self.0.scope(f)
    }
    fn download(&self, bufs: &[BufId], f: &mut dyn FnMut(&[&[u8]])) -> anyhow::Result<()> {
        self.0.download(bufs, f)
    }
    fn upload(
        &mut self,
        bufs: &[BufId],
        f: &mut dyn FnMut(&mut [&mut [u8]]),
    ) -> anyhow::Result<()> {
        self.0.upload(bufs, f)
    }
}
