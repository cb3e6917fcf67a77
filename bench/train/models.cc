#include "bench/train/models.h"

namespace membox::bench {
namespace {

void Conv(Layer& l, uint64_t in, uint64_t out, uint64_t k, bool bias) {
  l.tensors.push_back(out * in * k * k);
  if (bias) l.tensors.push_back(out);
}
void Norm(Layer& l, uint64_t c) {  // BatchNorm / LayerNorm: weight, bias
  l.tensors.push_back(c);
  l.tensors.push_back(c);
}
void Linear(Layer& l, uint64_t in, uint64_t out) {
  l.tensors.push_back(out * in);
  l.tensors.push_back(out);
}

// He et al. 2016, Table 1 (50-layer): bottleneck blocks [3, 4, 6, 3].
Model ResNet50() {
  Model m;
  m.name = "resnet50";
  Layer stem;
  Conv(stem, 3, 64, 7, false);
  Norm(stem, 64);
  m.layers.push_back(stem);
  const int blocks[] = {3, 4, 6, 3};
  uint64_t in = 64;
  for (int s = 0; s < 4; ++s) {
    uint64_t w = 64u << s;
    for (int b = 0; b < blocks[s]; ++b) {
      Layer l;
      Conv(l, in, w, 1, false);
      Norm(l, w);
      Conv(l, w, w, 3, false);
      Norm(l, w);
      Conv(l, w, 4 * w, 1, false);
      Norm(l, 4 * w);
      if (b == 0) {  // projection shortcut
        Conv(l, in, 4 * w, 1, false);
        Norm(l, 4 * w);
      }
      m.layers.push_back(l);
      in = 4 * w;
    }
  }
  Layer fc;
  Linear(fc, 2048, 1000);
  m.layers.push_back(fc);
  return m;
}

// Simonyan & Zisserman 2015, configuration D.
Model Vgg16() {
  Model m;
  m.name = "vgg16";
  const uint64_t convs[][2] = {{3, 64},    {64, 64},   {64, 128},  {128, 128},
                               {128, 256}, {256, 256}, {256, 256}, {256, 512},
                               {512, 512}, {512, 512}, {512, 512}, {512, 512},
                               {512, 512}};
  for (auto& c : convs) {
    Layer l;
    Conv(l, c[0], c[1], 3, true);
    m.layers.push_back(l);
  }
  const uint64_t fcs[][2] = {{25088, 4096}, {4096, 4096}, {4096, 1000}};
  for (auto& f : fcs) {
    Layer l;
    Linear(l, f[0], f[1]);
    m.layers.push_back(l);
  }
  return m;
}

// Devlin et al. 2019, BERT-large: 24 layers, hidden 1024, 16 heads,
// intermediate 4096, vocabulary 30522, 512 positions; SQuAD span head.
Model BertLarge() {
  Model m;
  m.name = "bert-large";
  const uint64_t h = 1024, ff = 4096;
  Layer emb;
  emb.tensors = {30522 * h, 512 * h, 2 * h};
  Norm(emb, h);
  m.layers.push_back(emb);
  for (int i = 0; i < 24; ++i) {
    Layer l;
    for (int q = 0; q < 4; ++q) Linear(l, h, h);  // Q, K, V, output
    Norm(l, h);
    Linear(l, h, ff);
    Linear(l, ff, h);
    Norm(l, h);
    m.layers.push_back(l);
  }
  Layer head;
  Linear(head, h, h);  // pooler
  Linear(head, h, 2);  // start / end logits
  m.layers.push_back(head);
  return m;
}

}  // namespace

uint64_t Model::bytes() const {
  uint64_t n = 0;
  for (auto& l : layers)
    for (auto t : l.tensors) n += 4 * t;
  return n;
}

size_t Model::tensors() const {
  size_t n = 0;
  for (auto& l : layers) n += l.tensors.size();
  return n;
}

Model MakeModel(const std::string& name) {
  Model m;
  // Compute per iteration: ResNet-50 and VGG-16 from seed 003's Table 2
  // (233 ms, 190 ms); BERT-large at batch 2 x 384 tokens has ~2x the
  // forward FLOPs of ResNet-50 at batch 64, so 2 x 233 ms. Backward = 2 x
  // forward.
  if (name == "resnet50") {
    m = ResNet50();
    m.forward_ms = 233.0 / 3;
  } else if (name == "vgg16") {
    m = Vgg16();
    m.forward_ms = 190.0 / 3;
  } else if (name == "bert-large") {
    m = BertLarge();
    m.forward_ms = 466.0 / 3;
  } else {
    return Model{};
  }
  m.backward_ms = 2 * m.forward_ms;
  m.step_ms = double(m.bytes()) / 4 * 28 / 450e9 * 1e3;
  return m;
}

}  // namespace membox::bench
